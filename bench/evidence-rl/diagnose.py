"""Where the evidence term's learning signal goes, from an RL run's recorded episodes (issue 56).

    python bench/evidence-rl/diagnose.py RUN_DIR [RUN_DIR ...] [--json OUT]

RUN_DIR is an RL run folder (its episodes.jsonl and the sessions it names). Reports, over the groups
(one task's episodes of one step):
- how often episodes of equal pass outcome differ in claim status (some state a false or unchecked
  claim, some do not): only there can a reward folded into the episode's total rank them apart;
- the closing sentences sampled (identifiers, paths and numbers replaced by placeholders), by outcome;
- the GRPO advantage with the evidence component and without it: how much of it the term moves;
- per step, the probability the sampler gave the false claims' own tokens (from the recorded
  completion log-probs; the clause located as train/claim_credit.py locates it): whether RL lowers it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.session import load  # noqa: E402
from agent.tasks.claims import SUPPORTED, check_session, final_answer  # noqa: E402
from train.claim_credit import clause_positions  # noqa: E402
from train.rl import claim_decoder  # noqa: E402

DECODE = claim_decoder(ROOT / "serve" / "builtin" / "composer-tiny")


def claim_logprob(data, clauses: list[str]) -> float | None:
    """Mean sampled log-prob of the false clauses' tokens in the last model turn, None if not located."""
    last = None
    for rec in data.records:
        if rec.get("type") == "request" and rec.get("purpose", "turn") == "turn" and rec.get("completion_token_ids"):
            last = rec
    if last is None or not clauses:
        return None
    ids, lps = last["completion_token_ids"], last["completion_logprobs"]
    pos = clause_positions(ids, (0, len(ids)), clauses, DECODE)
    return sum(lps[p] for p in pos) / len(pos) if pos else None


def shape(text: str) -> str:
    """A closing sentence with its particulars replaced, so equal phrasings count together."""
    s = re.sub(r"`[^`]*`", "`X`", text.strip())
    s = re.sub(r"\b[\w./-]+\.(py|js|ts|go|rs|txt|md)\b", "FILE", s)
    s = re.sub(r"\d+", "N", s)
    return s[:160]


def episodes(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines() if line.strip()]
    for r in rows:
        r["run"] = str(run)
        r["false"] = (r.get("unsupported_claims") or 0) + (r.get("contradicted_claims") or 0)
        r["answer"], r["bad_clauses"] = "", []
        if r.get("session") and Path(r["session"]).exists():
            data = load(Path(r["session"]))
            r["answer"] = final_answer(data)
            r["bad_clauses"] = [c.text for c in check_session(data) if c.status != SUPPORTED]
            r["claim_logprob"] = claim_logprob(data, r["bad_clauses"])
    return [r for r in rows if not r.get("infra_error")]


def grpo(rewards: list[float]) -> list[float]:
    m = sum(rewards) / len(rewards)
    return [0.0 if max(rewards) == min(rewards) else r - m for r in rewards]


def diagnose(rows: list[dict]) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["run"], r["step"], r["group"]), []).append(r)
    g = {"groups": len(groups), "all_fail": 0, "all_pass": 0, "mixed": 0,
         "fail_differ": 0, "pass_differ": 0, "any_equal_outcome_differ": 0,
         "groups_where_evidence_alone_gives_signal": 0}
    d_abs, adv_abs, flips, n = 0.0, 0.0, 0, 0
    false_fail_adv, false_pass_adv = [], []
    for eps in groups.values():
        passed = [bool(e["passed"]) for e in eps]
        g["all_fail" if not any(passed) else "all_pass" if all(passed) else "mixed"] += 1
        fails = [e["false"] > 0 for e in eps if not e["passed"]]
        passes = [e["false"] > 0 for e in eps if e["passed"]]
        fd, pd = len(set(fails)) > 1, len(set(passes)) > 1
        g["fail_differ"] += fd
        g["pass_differ"] += pd
        g["any_equal_outcome_differ"] += fd or pd
        full = [e["reward"] for e in eps]
        without = [e["reward"] - e["components"].get("evidence", 0.0) for e in eps]
        a_full, a_wo = grpo(full), grpo(without)
        if any(a_full) and not any(a_wo):
            g["groups_where_evidence_alone_gives_signal"] += 1
        for e, af, aw in zip(eps, a_full, a_wo, strict=True):
            n += 1
            d_abs += abs(af - aw)
            adv_abs += abs(af)
            flips += (af > 0) != (aw > 0) and abs(af - aw) > 1e-9
            if e["false"]:
                (false_pass_adv if e["passed"] else false_fail_adv).append(af - aw)
    fail_rows = [r for r in rows if not r["passed"]]
    pass_rows = [r for r in rows if r["passed"]]
    closings = {"failed": Counter(shape(r["answer"]) for r in fail_rows).most_common(8),
                "passed": Counter(shape(r["answer"]) for r in pass_rows).most_common(5)}
    clauses = Counter(c for r in rows for c in r["bad_clauses"]).most_common(8)
    by_step: dict[int, list[float]] = {}
    for r in fail_rows:
        if r.get("claim_logprob") is not None:
            by_step.setdefault(r["step"], []).append(r["claim_logprob"])
    prob = {k: {"episodes": len(v), "p_mean": round(sum(math.exp(x) for x in v) / len(v), 4)}
            for k, v in sorted(by_step.items())}
    answered = [r for r in fail_rows if r["answer"].strip()]
    return {
        "episodes": len(rows), "pass_rate": round(len(pass_rows) / max(1, len(rows)), 3),
        "false_claim_episodes": {"failed": sum(r["false"] > 0 for r in fail_rows), "of_failed": len(fail_rows),
                                 "passed": sum(r["false"] > 0 for r in pass_rows), "of_passed": len(pass_rows)},
        "status_of_failed": dict(Counter(r["status"] for r in fail_rows)),
        **g,
        "mean_abs_advantage": round(adv_abs / max(1, n), 4),
        "mean_abs_advantage_change_by_evidence": round(d_abs / max(1, n), 4),
        "advantage_sign_flips_by_evidence": flips,
        "evidence_advantage_change_of_false_claim_episodes": {
            "failed_mean": round(sum(false_fail_adv) / max(1, len(false_fail_adv)), 4),
            "passed_mean": round(sum(false_pass_adv) / max(1, len(false_pass_adv)), 4)},
        "false_claim_share_of_answered_failures": round(sum(r["false"] > 0 for r in answered) / max(1, len(answered)), 3),
        "false_claim_token_prob_in_failures_by_step": prob,
        "closings": closings, "false_clauses": clauses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = [r for run in a.runs for r in episodes(run)]
    report = diagnose(rows)
    text = json.dumps(report, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
