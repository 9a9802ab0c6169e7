"""Which closing a checkpoint writes, greedily, in the contexts of recorded episodes (issue 56).

    python bench/evidence-rl/closing_check.py NAME=MODEL_DIR... [--run /tmp/m56/probe-w20-s0/rl] [--n 24] [--json OUT]

Each recorded episode's conversation up to its closing turn (its messages through the last tool result,
as honest_teacher.py cuts them) is sent to the checkpoint served by composer-serve (float64, T=0, the
episode's own tools); the reply is what the model would close with at that point. The reply's claims are
checked against the episode's own tool log (agent/tasks/claims.py), so the check needs no rollout: a cheap
look at whether the honest closing is in the greedy policy, for failing and for passing contexts apart.
Contexts come from a run kept out of the teacher data (default: the weight-20 probe).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from honest_teacher import conversation  # noqa: E402

from agent.session import load  # noqa: E402
from agent.tasks.claims import SUPPORTED, check_claims, steps_of  # noqa: E402


def contexts(run: Path, n: int) -> list[dict]:
    """Up to n failing and n passing distinct contexts of the run."""
    out, seen, got = [], set(), Counter()
    for line in (run / "episodes.jsonl").read_text().splitlines():
        ep = json.loads(line)
        if ep.get("infra_error") or not ep.get("session") or got[ep["passed"]] >= n:
            continue
        data = load(Path(ep["session"]))
        msgs = conversation(data)
        if msgs is None:
            continue
        key = json.dumps(msgs[2:], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        got[ep["passed"]] += 1
        out.append({"passed": ep["passed"], "messages": msgs, "tools": data.meta.get("tools"), "steps": steps_of(data)})
    return out


def ask(server, ctx: dict) -> dict:
    body = {"model": server.model, "messages": ctx["messages"], "tools": ctx["tools"], "temperature": 0.0,
            "max_tokens": 96}
    req = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {server.api_key}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["message"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--run", type=Path, default=Path("/tmp/m56/probe-w20-s0/rl"))
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from train.server import launch

    ctxs = contexts(a.run, a.n)
    report = {}
    for spec in a.models:
        name, _, model = spec.partition("=")
        server = launch(Path(model), "--dtype", "float64", name="policy")
        rows = Counter()
        examples = Counter()
        try:
            for c in ctxs:
                msg = ask(server, c)
                text = msg.get("content") or ""
                side = "failing" if not c["passed"] else "passing"
                if msg.get("tool_calls"):
                    rows[f"{side}: another tool call"] += 1
                    continue
                if not text.strip():
                    rows[f"{side}: empty answer"] += 1
                    continue
                bad = [x for x in check_claims(text, c["steps"]) if x.status != SUPPORTED]
                rows[f"{side}: {'false claim' if bad else 'true answer'}"] += 1
                examples[f"{side}: {text[:100]}"] += 1
        finally:
            server.stop()
        report[name] = {"counts": dict(sorted(rows.items())), "closings": examples.most_common(8)}
        print(name, json.dumps(report[name], indent=1), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"run": str(a.run), "contexts": len(ctxs), "report": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
