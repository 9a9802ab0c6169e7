"""The task suites, measured with the scripted expert through the real harness.

    python bench/eval.py [--seeds 3] [--concurrency 1 4 8]

1. The expert's pass rate per family and size on the synthetic suite (should be 100%: it validates
   the verifiers), with tokens, tool calls and turns per episode.
2. Harness overhead: episodes per minute at each concurrency on the same tasks (the expert answers
   instantly, so this is the agent loop, the tools, workspace copies and verification).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from agent.config import Config
    from agent.tasks.eval import EvalConfig, run_eval, table
    from agent.tasks.expert import ExpertServer
    from agent.tasks.suites import synthetic

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    args = p.parse_args()
    tasks = synthetic(range(args.seeds))
    quiet = open("/dev/null", "w")  # noqa: SIM115
    with ExpertServer(tasks) as srv:
        config = Config(base_url=srv.base_url, model="expert")
        rates = []
        for c in args.concurrency:
            out = Path(tempfile.mkdtemp(prefix=f"bench-eval-c{c}-"))
            t0 = time.monotonic()
            report = run_eval(tasks, config, EvalConfig(concurrency=c, sandbox=False), out, log=quiet)
            wall = time.monotonic() - t0
            rates.append((c, len(tasks) / wall * 60, report))
            print(f"concurrency {c}: {len(tasks)} episodes in {wall:.1f} s = {len(tasks) / wall * 60:.1f} episodes/min, "
                  f"pass@1 {report['overall']['pass@1']}", flush=True)
    print(f"\n{len(tasks)} tasks (4 families x 3 sizes x {args.seeds} seeds), the scripted expert:\n")
    print(table(rates[0][2], 1))
    print("\n| concurrency | episodes/min |\n| --- | --- |")
    for c, rate, _ in rates:
        print(f"| {c} | {rate:.1f} |")


if __name__ == "__main__":
    main()
