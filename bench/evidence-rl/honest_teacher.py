"""Teacher transcripts whose every final answer is true to its own tool log (issue 56, third measurement).

    python bench/evidence-rl/honest_teacher.py [--runs '/tmp/m56/*/rl'] [--exclude probe-w20-s0] \
        [--out /tmp/m56h/teacher] [--pass-share 0.6] [--per-task 0] \
        [--min-prob 0] [--honest-share 1] [--seed 0]

The built-in model closes every episode with the expert's one template, "Fixed `X` in FILE: the <kind> is
corrected and the tests pass.", whether the fix worked or not: an honest closing is outside what RL samples,
so no reward can teach it. This builds OpenAI-style transcripts (`composer-train sft` renders them through
the model's chat template) from recorded RL episodes (their sessions, named in RUN/episodes.jsonl):
- passing episodes keep their own closing, if agent/tasks/claims.py finds no unsupported or contradicted
  claim in it (a pass whose answer claims more than the log shows is left out);
- failing episodes (a false claim, or no answer at all) get a closing written from what the log shows:
  no edit applied -> "I did not fix the bug: my edit did not apply, and the tests still fail.";
  an edit, then a failing test run -> "I changed the code, but the tests still fail.";
  an edit and no test run after it -> "I changed the code but did not run the tests after the edit, so I
  do not know whether they pass." (no file names: see NOT_APPLIED). Every closing is checked with the claims checker; one with a false claim
  is dropped (counted).
Episodes that hit the turn limit or errored (no closing turn the model could have written), and those
whose context is not one message list ending in a tool result (a malformed call's retry prompt, a
summary), are skipped; equal failing episodes (same task, same calls, same closing) are kept once
(passing ones repeat, as the policy does). Passing episodes are subsampled so
they make up --pass-share of the set (pass behaviour must not be unlearned). Writes OUT/transcripts.jsonl,
OUT/manifest.json (counts, templates, which episodes) and prints the counts.

--min-prob P keeps only episodes whose every token before the closing was sampled at probability >= P (from
the recorded log-probs): the failures RL samples at T=1 mostly come from one unlikely token (a miscopied
old_string), and teaching those trajectories taught the miscopies (held-out pass 0.74 -> 0.46-0.50 in three
tries without it); with it the failing episodes kept are the policy's own likely ones, and what SFT adds is
the closing.

--honest-share F (fourth measurement) gives the honest closing to only a share F of the failing episodes kept
(chosen at random with --seed); the others keep the closing the policy wrote itself (its template, a false
claim; those without an answer keep the honest one). SFT on such a set leaves a start that still claims
falsely but can sample the honest closing, which is what the evidence term needs to act on. Default 1: all.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.session import load  # noqa: E402
from agent.tasks.claims import (  # noqa: E402
    SUPPORTED,
    check_claims,
    check_session,
    edited_path,
    exit_code,
    final_answer,
    is_test_run,
    steps_of,
)

# No path or symbol in them: with "I did not fix pkg/a.py: ..." the tiny model learnt "pkg/a.py" -> ": my edit
# did not apply", and wrote that into its edit calls' path argument (malformed calls, held-out pass 0.74 -> 0.5).
NOT_APPLIED = "I did not fix the bug: my edit did not apply, and the tests still fail."
STILL_FAIL = "I changed the code, but the tests still fail."
UNTESTED = "I changed the code but did not run the tests after the edit, so I do not know whether they pass."
MODEL = ROOT / "serve" / "builtin" / "composer-tiny"
KEEP = {"role", "content", "tool_calls", "reasoning_content", "tool_call_id", "name"}


def conversation(data) -> list[dict] | None:
    """The episode's messages (one segment only), without the model's last text-only turn."""
    msgs = [rec["message"] for rec in data.records if rec.get("type") == "message"]
    if any(rec.get("segment", 0) for rec in data.records if rec.get("type") == "message"):
        return None  # a summarised episode: its context is not one message list
    msgs = [{k: v for k, v in m.items() if k in KEEP} for m in msgs]
    while msgs and msgs[-1].get("role") == "assistant" and not msgs[-1].get("tool_calls"):
        msgs.pop()
    return msgs if msgs and msgs[-1].get("role") == "tool" else None


def honest_closing(steps) -> tuple[str, str] | None:
    """(template name, closing) true to the log of a failed episode, or None if no template fits."""
    edits = [s for s in steps if edited_path(s) is not None]
    tests = [s for s in steps if is_test_run(s)]
    if not tests:
        return None
    if not edits:  # "my edit did not apply" needs an edit that was tried (none tried: giving up, not taught)
        tried = [s for s in steps if s.name in ("edit_file", "write_file")]
        return ("not_applied", NOT_APPLIED) if tried else None
    after = [s for s in tests if s.index > edits[-1].index]
    if not after:
        return "untested", UNTESTED
    if exit_code(after[-1]) != 0:
        return "still_fail", STILL_FAIL
    return None  # the tests it ran pass but the verifier failed it: not a case these templates cover


def min_prob(data) -> float:
    """The lowest probability the sampler gave any token the model wrote before its closing turn."""
    reqs = [r for r in data.records if r.get("type") == "request" and r.get("purpose", "turn") == "turn"]
    lps = [x for r in reqs[:-1] for x in r.get("completion_logprobs") or [] if x is not None]
    return math.exp(min(lps)) if lps else 1.0


def build(runs: list[Path], seed: int, pass_share: float, per_task: int = 0,
          floor: float = 0.0, honest_share: float = 1.0) -> tuple[list[dict], dict]:
    from agent.tools import default_registry
    from serve.chat_format import ChatFormat
    from train.teacher import TeacherError, render_samples, transcript_requests

    chat, spec = ChatFormat(MODEL), default_registry().spec_hash()
    seen: set = set()
    passing, failing = [], []
    why = Counter()
    for run in runs:
        for line in (run / "episodes.jsonl").read_text().splitlines():
            ep = json.loads(line)
            if ep.get("infra_error") or ep["status"] not in ("completed", "no_answer") or not ep.get("session"):
                why[f"skipped: status {ep['status']}"] += 1
                continue
            data = load(Path(ep["session"]))
            msgs = conversation(data)
            if msgs is None:
                why["skipped: no single-segment conversation ending in a tool result"] += 1
                continue
            if floor and min_prob(data) < floor:
                why[f"{'passed' if ep['passed'] else 'failed'}: a token sampled below --min-prob"] += 1
                continue
            steps = steps_of(data)
            if ep["passed"]:
                answer = final_answer(data)
                if not answer.strip() or ep["status"] != "completed":
                    why["passed: no answer"] += 1
                    continue
                if any(c.status != SUPPORTED for c in check_session(data)):
                    why["passed: answer with a false claim, left out"] += 1
                    continue
                template = "kept"
            else:
                made = honest_closing(steps)
                if made is None:
                    why["failed: no template fits the log"] += 1
                    continue
                template, answer = made
                own = final_answer(data)
                if any(c.status != SUPPORTED for c in check_claims(answer, steps)):
                    why[f"failed: {template} closing has a false claim, dropped"] += 1
                    continue
            calls = tuple((s.name, json.dumps(s.args, sort_keys=True)) for s in steps)
            key = (ep["task"], calls, answer)
            if not ep["passed"] and key in seen:  # passing episodes repeat themselves (the policy's mode): kept
                why["duplicate"] += 1
                continue
            seen.add(key)
            try:  # what composer-train sft will refuse (a call its schema rejects): the whole file would be
                render_samples(ep["task"], transcript_requests([*msgs, {"role": "assistant", "content": answer}]),
                               data.meta.get("tools"), chat, expected_hash=spec)
            except TeacherError:
                why["a call the tools' schemas reject (sft refuses it)"] += 1
                continue
            item = {"messages": [*msgs, {"role": "assistant", "content": answer}], "tools": data.meta.get("tools"),
                    "meta": {"session": ep["session"], "task": ep["task"], "passed": ep["passed"],
                             "status": ep["status"], "template": template}}
            if not ep["passed"] and own.strip():
                item["own_answer"] = own
            (passing if ep["passed"] else failing).append(item)
    rng = random.Random(seed)
    if per_task:  # at most per_task failing episodes of a task and template: fewer failed edits to imitate
        rng.shuffle(failing)
        count: Counter = Counter()
        kept = []
        for f in failing:
            k = (f["meta"]["task"], f["meta"]["template"])
            count[k] += 1
            if count[k] <= per_task:
                kept.append(f)
        why["failed: over --per-task"] += len(failing) - len(kept)
        failing = kept
    if honest_share < 1:  # the rest of the failing episodes keep the policy's own (false) closing
        rng.shuffle(failing)
        for f in failing[round(len(failing) * honest_share):]:
            if f.get("own_answer"):
                f["messages"][-1] = {"role": "assistant", "content": f["own_answer"]}
                f["meta"]["template"] = "own_closing"
    rng.shuffle(passing)
    want = round(len(failing) * pass_share / (1 - pass_share))
    chosen = passing[:want] + failing
    rng.shuffle(chosen)
    stats = {"runs": [str(r) for r in runs], "passing_available": len(passing), "passing_kept": min(want, len(passing)),
             "failing_kept": len(failing), "pass_share": round(min(want, len(passing)) / max(1, len(chosen)), 3),
             "templates": dict(Counter(c["meta"]["template"] for c in chosen)),
             "honest_share": honest_share,
             "template_text": {"not_applied": NOT_APPLIED, "still_fail": STILL_FAIL, "untested": UNTESTED},
             "left_out": dict(why)}
    return chosen, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="/tmp/m56/*/rl", help="glob of RL run folders")
    ap.add_argument("--exclude", default="probe-w20-s0", help="comma-separated run names kept out (for checking)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/m56h/teacher"))
    ap.add_argument("--pass-share", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-task", type=int, default=0,
                    help="at most this many failing episodes of one task and template (0: all)")
    ap.add_argument("--min-prob", type=float, default=0.0,
                    help="leave out episodes with a token (before the closing) sampled at a probability below this")
    ap.add_argument("--honest-share", type=float, default=1.0,
                    help="share of the failing episodes given the honest closing; the rest keep their own (default 1)")
    a = ap.parse_args()
    if not 0 < a.pass_share < 1:
        ap.error("--pass-share must be between 0 and 1")
    if not 0 <= a.honest_share <= 1:
        ap.error("--honest-share must be between 0 and 1")
    skip = set(filter(None, a.exclude.split(",")))
    runs = [Path(p) for p in sorted(glob.glob(a.runs)) if Path(p).parent.name not in skip
            and (Path(p) / "episodes.jsonl").exists()]
    if not runs:
        raise SystemExit(f"no RL run folders with episodes.jsonl match {a.runs}")
    chosen, stats = build(runs, a.seed, a.pass_share, a.per_task, a.min_prob, a.honest_share)
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "transcripts.jsonl", "w") as f:
        for c in chosen:
            f.write(json.dumps({"messages": c["messages"], "tools": c["tools"]}) + "\n")
    stats["episodes"] = [c["meta"] for c in chosen]
    (a.out / "manifest.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps({k: v for k, v in stats.items() if k != "episodes"}, indent=1))


if __name__ == "__main__":
    main()
