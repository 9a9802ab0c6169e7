"""Step time with a heavy-tailed mix of episode times: does a step wait on its slowest episode?

    python bench/stragglers.py [--steps 12] [--overprovision 2] [--max-staleness 1] [--out bench/stragglers-results]

Episodes run through the real harness (train.rollouts: workspace, agent loop, session, token-exact
samples) against the scripted expert token server on the tiny checkpoint's chat format, answering one
"Done." turn; the verify command sleeps (0.4 s, or 4 s for the slow tenth of the tasks: 10x) and then
flips a coin, so groups carry a learning signal (mixed rewards). The trainer is a fixed 0.5 s sleep,
then the version moves on, as train/rl.py does. Three mixes: no slow tasks with the plain batches
(the reference), slow tasks with the plain batches (before), slow tasks with FirstGroups and
--overprovision N (after). Reported per mix: step time (wait for the batch + the 0.5 s step) median
and p90, episodes trained per step, groups with mixed rewards per step (what GRPO learns from), mean
staleness, groups carried and dropped, and the share of slow-task groups among those trained on (a
step that trains on the first groups to finish must not simply leave the slow tasks out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tasks(base: Path, slow_share: float, n: int = 20) -> list:
    from agent.tasks import Task

    ws = base / "ws"
    ws.mkdir(parents=True, exist_ok=True)
    (ws / "a.py").write_text("x = 1\n")
    slow = set(range(0, n, round(1 / slow_share))) if slow_share else set()
    return [Task(f"{'slow' if i in slow else 'fast'}-{i}", f"look at a.py ({i})",
                 f"sleep {4.0 if i in slow else 0.4}; test $((RANDOM % 2)) -eq 0", workspace=str(ws), max_turns=2)
            for i in range(n)]


def run_mix(name: str, ckpt: Path, task_list: list, steps: int, overprovision: int, out: Path,
            staleness: int) -> dict:
    from agent.tools import default_registry
    from train.expert_data import ExpertTokenServer
    from train.rewards import RewardConfig, compose
    from train.rollout import RolloutConfig
    from train.rollouts import FirstGroups, RLConfig, Rollouts

    class Done(ExpertTokenServer):
        def completion(self, messages, tools) -> str:
            return self.completion_text(messages, tools, {"content": "Done."})

    cfg = RLConfig(steps=steps, group_size=4, groups_per_step=4, workers=4, max_staleness=staleness,
                   overprovision=overprovision)
    rows = []
    with Done(ckpt, task_list) as srv:
        rollout = RolloutConfig(srv.base_url, srv.name, max_output_tokens=64, sandbox=False)
        ro = (FirstGroups if overprovision else Rollouts)(task_list, cfg, rollout, compose(RewardConfig()),
                                                           out / name, 0, 0, default_registry().spec_hash())
        try:
            for k in range(steps):
                t0 = time.monotonic()
                eps, _ = ro.batch(k)
                wait = time.monotonic() - t0
                time.sleep(0.5)  # the trainer's step
                srv.version = k + 1  # the weights a real run would load: episodes from now on say so
                ro.set_version(k + 1)
                groups: dict[int, list] = {}
                for e in eps:
                    groups.setdefault(e.group, []).append(e)
                rows.append({"step": k, "wait_s": wait, "step_s": time.monotonic() - t0, "episodes": len(eps),
                             "mixed_groups": sum(len({e.reward for e in g}) > 1 for g in groups.values()),
                             "staleness": statistics.mean(k - e.min_version for e in eps),
                             "slow_groups": sum(g[0].task_id.startswith("slow") for g in groups.values()),
                             "groups": len(groups), **getattr(ro, "last_counts", {})})
                print(f"{name} step {k}: {rows[-1]['step_s']:.2f}s, {len(eps)} episodes, "
                      f"{sum(bool(e.infra_error) for e in eps)} infra errors", file=sys.stderr, flush=True)
        finally:
            ro.close()
    warm = rows[1:]  # step 0 includes start-up
    st = [r["step_s"] for r in warm]
    return {"mix": name, "overprovision": overprovision, "max_staleness": staleness, "steps": len(warm),
            "step_s_median": round(statistics.median(st), 3),
            "step_s_p90": round(sorted(st)[int(0.9 * (len(st) - 1))], 3), "step_s_max": round(max(st), 3),
            "episodes_per_step": round(statistics.mean(r["episodes"] for r in warm), 2),
            "mixed_groups_per_step": round(statistics.mean(r["mixed_groups"] for r in warm), 2),
            "staleness_mean": round(statistics.mean(r["staleness"] for r in warm), 3),
            "slow_group_share": round(sum(r["slow_groups"] for r in warm) / sum(r["groups"] for r in warm), 3),
            "groups_carried": sum(r.get("groups_carried", 0) for r in warm),
            "groups_dropped_stale": sum(r.get("groups_dropped_stale", 0) for r in warm), "per_step": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--overprovision", type=int, nargs="+", default=[2])
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench" / "stragglers-results"))
    args = p.parse_args()
    from serve.tiny import build_tiny_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        ckpt = build_tiny_checkpoint(base / "ckpt", template="hermes")
        plain, tailed = tasks(base / "plain", 0.0), tasks(base / "tailed", 0.1)
        s = args.max_staleness
        results = [run_mix("no-tail", ckpt, plain, args.steps, 0, base, s),
                   run_mix("tail", ckpt, tailed, args.steps, 0, base, s)]
        results += [run_mix(f"tail-first-groups-{n}", ckpt, tailed, args.steps, n, base, s) for n in args.overprovision]
    (out / f"stragglers-s{args.max_staleness}.json").write_text(json.dumps(results, indent=2))
    cols = ["mix", "step_s_median", "step_s_p90", "step_s_max", "episodes_per_step", "mixed_groups_per_step",
            "staleness_mean", "slow_group_share", "groups_carried", "groups_dropped_stale"]
    print("| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        ax.boxplot([[s["step_s"] for s in r["per_step"][1:]] for r in results], tick_labels=[r["mix"] for r in results])
        ax.set_ylabel("step time (s)")
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        fig.savefig(out / f"stragglers-s{args.max_staleness}.png", dpi=110)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
