"""Rollout scale-out on this machine: episodes/minute at 1, 2, 4 rollout workers on each backend
(threads in the trainer's process, a local process pool, Ray actors), the per-episode overhead of
each backend, and the queue waits.

    python bench/scale.py [--workers 1 2 4] [--episodes 8] [--backends threads processes ray] [--repeat 1]

Each measurement runs two batches: the first warms the pool up (process spawn, actor start-up: shown
as "first batch"), the second is timed (episodes/min, queue waits). The model is the scripted expert token server (train.expert_data.ExpertTokenServer: the tiny
checkpoint's chat format, token ids, instant answers), so an episode is the harness alone: workspace
copy, agent loop and tools, the pytest runs of the expert's plan, verification. Two workloads:

  expert   the synthetic suite's small tasks solved by the expert (real work per episode: pytest);
  trivial  one "Done." turn and `verify: true` (almost no work: what is left is the backend's
           overhead per episode: dispatch, queues, pickling, session file, sample building).

Backends take turns within each repeat on the same tasks. Ray starts a local cluster with as many
logical CPUs as the most workers asked for (more than this machine's cores: say so when reading
the numbers). Prints a table; writes JSON and a plot next to it (--out, default /tmp/composer-bench-scale).
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
CKPT = Path("/tmp/composer-bench-scale-tiny")


def trivial_tasks(base: Path) -> list:
    from agent.tasks import Task

    ws = base / "ws"
    ws.mkdir(parents=True, exist_ok=True)
    (ws / "a.py").write_text("x = 1\n")
    return [
        Task(f"trivial-{i}", f"look at a.py ({i})", "true", workspace=str(ws), max_turns=2) for i in range(4)
    ]


def make_server(kind: str, tasks):
    from train.expert_data import ExpertTokenServer

    class Done(ExpertTokenServer):
        def completion(self, messages, tools) -> str:
            return self.completion_text(messages, tools, {"content": "Done."})

    return (Done if kind == "trivial" else ExpertTokenServer)(CKPT, tasks)


def cpu_s(pid: int) -> float:
    """CPU seconds of a process and of its children it has waited for (tool and verify commands)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_once(backend: str, workers: int, tasks, episodes: int, srv, out: Path) -> dict:
    from agent.tools import default_registry
    from train.rewards import RewardConfig, compose
    from train.rl import RLConfig, Rollouts
    from train.rollout import RolloutConfig

    groups = min(len(tasks), episodes)
    cfg = RLConfig(
        steps=2,
        group_size=max(1, episodes // groups),
        groups_per_step=groups,
        workers=workers,
        max_staleness=0,
    )  # batch 0 warms the pool up (start-up included), batch 1 is measured
    rollout = RolloutConfig(srv.base_url, srv.name, max_output_tokens=512, sandbox=False)
    spec = default_registry().spec_hash()
    t0 = time.monotonic()
    if backend == "threads":
        ro = Rollouts(tasks, cfg, rollout, compose(RewardConfig()), out, 0, 0, spec)
    else:
        from train.distributed.rollouts import DistributedRollouts

        ro = DistributedRollouts(tasks, cfg, rollout, RewardConfig(), out, 0, 0, spec, backend=backend)
    try:
        ro.batch(0)
        first = time.monotonic() - t0
        skip = len(getattr(ro, "timings", []))
        procs = getattr(getattr(ro, "backend", None), "procs", {})
        cpu0 = sum(cpu_s(pr.pid) for pr in procs.values())
        t0 = time.monotonic()
        ro.set_version(1)
        eps, _ = ro.batch(1)
        wall = time.monotonic() - t0
        cpu1 = sum(cpu_s(pr.pid) for pr in procs.values())
        rss = [rss_mb(pr.pid) for pr in procs.values()]
    finally:
        ro.close()
    n = len(eps)
    row = {
        "backend": backend,
        "workers": workers,
        "episodes": n,
        "first_batch_s": round(first, 2),
        "wall_s": round(wall, 2),
        "episodes_per_min": round(n / wall * 60, 1),
        "passed": sum(e.passed for e in eps),
        "infra_errors": sum(bool(e.infra_error) for e in eps),
        "episode_s_median": round(statistics.median(e.duration_s for e in eps), 3),
    }
    timings = getattr(ro, "timings", [])[skip:]
    if procs:  # worker processes: CPU per episode (tools, verify and all their subprocesses), memory
        row |= {
            "cpu_s_per_episode": round((cpu1 - cpu0) / n, 2),
            "worker_rss_mb": round(statistics.median(rss)),
        }
    if timings:
        row |= {
            "task_wait_s_median": round(statistics.median(t["task_wait_s"] for t in timings), 3),
            "task_wait_s_max": round(max(t["task_wait_s"] for t in timings), 3),
            "result_wait_s_median": round(statistics.median(t["result_wait_s"] for t in timings), 4),
            "result_wait_s_max": round(max(t["result_wait_s"] for t in timings), 4),
        }
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--episodes", type=int, default=8, help="episodes per measurement")
    p.add_argument("--backends", nargs="+", default=["threads", "processes", "ray"])
    p.add_argument("--workloads", nargs="+", default=["trivial", "expert"])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", default="/tmp/composer-bench-scale")
    args = p.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    from agent.tasks.suites import synthetic
    from serve.tiny import build_tiny_checkpoint

    if not (CKPT / "config.json").exists():
        build_tiny_checkpoint(CKPT, template="hermes")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    startup = {}
    if "ray" in args.backends:
        import ray

        t0 = time.monotonic()
        ray.init(num_cpus=max(args.workers), include_dashboard=False, log_to_driver=False)
        startup["ray_init_s"] = round(time.monotonic() - t0, 2)
    rows = []
    print(f"{os.cpu_count()} CPU cores; {args.episodes} episodes per measurement", flush=True)
    for workload in args.workloads:
        tasks = trivial_tasks(out) if workload == "trivial" else synthetic(range(1), sizes=("small",))
        with make_server(workload, tasks) as srv:
            for rep in range(args.repeat):
                for w in args.workers:
                    for b in args.backends:  # backends take turns: the machine drifts
                        row = run_once(b, w, tasks, args.episodes, srv, Path(tempfile.mkdtemp(dir=out)))
                        row |= {"workload": workload, "repeat": rep}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    (out / "scale.json").write_text(
        json.dumps({"startup": startup, "rows": rows, "cores": os.cpu_count()}, indent=2)
    )
    print(f"\nstartup: {startup}\n")
    print(
        "| workload | backend | workers | episodes/min | median episode s | first batch s (start-up) "
        "| task wait s (median/max) | result wait s (median/max) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        waits = (
            f"{r['task_wait_s_median']}/{r['task_wait_s_max']} | {r['result_wait_s_median']}/"
            f"{r['result_wait_s_max']}"
            if "task_wait_s_median" in r
            else "- | -"
        )
        print(
            f"| {r['workload']} | {r['backend']} | {r['workers']} | {r['episodes_per_min']} | "
            f"{r['episode_s_median']} | {r['first_batch_s']} | {waits} |"
        )
    plot(rows, out / "scale.png")
    print(f"\n{out / 'scale.json'}, {out / 'scale.png'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.5), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=True):
        for b in sorted({r["backend"] for r in rows}):
            pts: dict[int, list[float]] = {}
            for r in rows:
                if r["workload"] == wl and r["backend"] == b:
                    pts.setdefault(r["workers"], []).append(r["episodes_per_min"])
            xs = sorted(pts)
            ax.plot(xs, [statistics.median(pts[x]) for x in xs], marker="o", label=b)
        ax.set(title=f"{wl} episodes", xlabel="rollout workers", ylabel="episodes / min", xticks=xs)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
