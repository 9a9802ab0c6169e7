"""A full RL step on CPU, measured: steps/s, tokens/s, and where the time goes, synchronous vs async.

    python bench/train.py [--steps 4] [--group-size 4] [--groups 2] [--workers 4] [--repeat 2]
    python bench/train.py --staleness 1 --threads auto,all   # sharing the CPU: split vs every core each

Builds (once, under /tmp) the tiny random Qwen3-MoE checkpoint and a small task suite (a real
workspace; the verify command is a coin flip so that rewards vary, which is all the timing needs),
then runs `composer-train rl` in-process with --max-staleness 0 and 1 (--staleness), taking turns
--repeat times on the same seed. --threads: "auto" is what rl.run does on CPU (with --max-staleness
above 0 the launched composer-serve and the trainer get half the cores each; synchronous, each takes
every core); "all" is what it did before (both take every core: OMP_NUM_THREADS set to the core count,
which rl.run leaves alone). Reported per setting (medians over runs): wall time per step, steps/s, sampled
tokens/s, and the split of a step into rollout (episodes through the real agent loop and
composer-serve), scoring (verify commands), training (the optimizer step) and weight sync, plus the
share of the run's wall time the trainer spent waiting for rollouts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CKPT = Path("/tmp/composer-bench-train-tiny")


def suite(base: Path) -> Path:
    ws = base / "ws"
    ws.mkdir(parents=True, exist_ok=True)
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    lines = [json.dumps({"id": f"coin-{i}", "workspace": "ws", "prompt": f"fix add in calc.py ({i})",
                         "verify": "test $((RANDOM % 2)) -eq 0", "max_turns": 2}) for i in range(4)]
    (base / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    return base / "tasks.jsonl"


def one_run(staleness: int, threads: str, args, tasks_path: Path) -> dict:
    import torch

    from agent.tasks import load_tasks
    from train.progress import Progress
    from train.rl import RLConfig, run
    from train.trainer import TrainerConfig

    out = Path(tempfile.mkdtemp(prefix=f"bench-train-s{staleness}-"))
    cfg = RLConfig(steps=args.steps, group_size=args.group_size, groups_per_step=args.groups, workers=args.workers,
                   max_staleness=staleness, seed=0, save_every=10**9, max_output_tokens=args.tokens)
    before = torch.get_num_threads()
    if threads == "all":
        cores = len(os.sched_getaffinity(0))
        os.environ["OMP_NUM_THREADS"] = str(cores)
        torch.set_num_threads(cores)
    else:
        os.environ.pop("OMP_NUM_THREADS", None)
    t0 = time.monotonic()
    hist = run(CKPT, load_tasks(tasks_path), out, cfg, trainer_cfg=TrainerConfig(lr=1e-4),
               progress=Progress(args.steps, out=open("/dev/null", "w")))
    wall = time.monotonic() - t0
    torch.set_num_threads(before)
    eps = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    tokens = sum(m["completion_tokens"] for m in hist)
    return {"wall_s": wall, "step_s": wall / len(hist), "tokens_per_s": tokens / wall,
            "rollout_s": statistics.mean(m["rollout_s"] for m in hist),
            "score_s": sum(e["verify_s"] for e in eps) / len(hist),
            "train_s": statistics.mean(m.get("train_s", 0.0) for m in hist),
            "sync_s": statistics.mean(m["sync_s"] for m in hist),
            "wait_share": sum(m["wait_s"] for m in hist) / wall,
            "staleness": statistics.mean(m["staleness_mean"] for m in hist),
            "dropped": sum(m["dropped_stale"] for m in hist), "masked": sum(m["infra_masked"] for m in hist)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--staleness", default="0,1", help="comma-separated --max-staleness settings")
    p.add_argument("--threads", default="auto", help="comma-separated: auto (rl.run's choice), all (every core each)")
    args = p.parse_args()
    if "OMP_NUM_THREADS" in os.environ:
        sys.exit("unset OMP_NUM_THREADS: --threads sets it per setting")
    settings = [(int(s), t) for s in args.staleness.split(",") for t in args.threads.split(",")]
    if any(t not in ("auto", "all") for _, t in settings):
        sys.exit("--threads takes auto and/or all")
    from serve.tiny import build_tiny_checkpoint

    if not (CKPT / "config.json").exists():
        build_tiny_checkpoint(CKPT, template="hermes")
    tasks_path = suite(Path(tempfile.mkdtemp(prefix="bench-train-tasks-")))
    runs: dict[tuple[int, str], list[dict]] = {st: [] for st in settings}
    for r in range(args.repeat):
        for s, t in settings:
            res = one_run(s, t, args, tasks_path)
            runs[(s, t)].append(res)
            print(f"run {r + 1}/{args.repeat} staleness {s} threads {t}: " + ", ".join(f"{k} {v:.3g}" for k, v in res.items()),
                  flush=True)
    keys = ["step_s", "tokens_per_s", "rollout_s", "score_s", "train_s", "sync_s", "wait_share", "staleness",
            "dropped", "masked"]
    print(f"\n{args.steps} steps x {args.groups} tasks x {args.group_size} episodes, workers {args.workers}, "
          f"max_tokens {args.tokens}; medians of {args.repeat}\n")
    print("| max-staleness | threads | " + " | ".join(keys) + " | steps/s |")
    print("| --- " * (len(keys) + 3) + "|")
    for s, t in settings:
        med = {k: statistics.median(r[k] for r in runs[(s, t)]) for k in keys}
        print(f"| {s} | {t} | " + " | ".join(f"{med[k]:.3g}" for k in keys) + f" | {1 / med['step_s']:.3g} |")


if __name__ == "__main__":
    main()
