"""How far the trainer's log-probs are from the server's, with and without routing replay.

Real RL rollouts (train/rollout.py: the deployed harness, T=1) of a composer-tiny checkpoint on bugfix
tasks against composer-serve in each --dtype; then the trainer (float32, the checkpoint's experts)
scores the very same samples twice, once routing every token itself and once replaying the experts
the server used (return_routed_experts). Prints, per server dtype, the log-prob gap over sampled tokens
and how many (token, MoE layer) routes the trainer would have chosen otherwise.

    python bench/routing_replay.py [--model serve/builtin/composer-tiny] [--dtypes float32,bfloat16]
        [--tasks 8] [--out bench/routing-replay/results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rollouts(model: Path, dtype: str, tasks, max_tokens: int):
    from train.rollout import RolloutConfig, run_episode
    from train.server import launch

    server = launch(model, "--dtype", dtype, name="policy")
    try:
        cfg = RolloutConfig(server.base_url, "policy", api_key=server.api_key, temperature=1.0,
                            max_output_tokens=max_tokens)
        samples = []
        for i, task in enumerate(tasks):
            ep = run_episode(task, i, cfg)
            if ep.infra_error:
                raise RuntimeError(f"{task.id}: {ep.infra_error}")
            samples += ep.samples
            print(f"  {dtype}: episode {i + 1}/{len(tasks)}, {sum(s.sampled_tokens for s in samples)} sampled tokens",
                  flush=True)
        return samples
    finally:
        server.stop()


def gaps(model: Path, samples, replay: bool) -> dict:
    import torch

    from train.checkpoint import read_policy
    from train.trainer import Trainer, TrainerConfig

    mxfp8 = read_policy(model).get("experts") == "mxfp8"
    trainer = Trainer(model, TrainerConfig(mxfp8_experts=mxfp8, replay_routes=replay, dtype="float32"))
    own: list[torch.Tensor] = []  # the router's own top-k per MoE layer, however the forward then routes
    hooks = [moe.gate.register_forward_hook(lambda m, i, out, k=moe.top_k: own.append(out.softmax(-1).topk(k).indices))
             for moe in trainer.model.moe_layers()]
    diffs, differ, routed = [], 0, 0
    for s in samples:
        own.clear()
        lp = trainer.logprobs([s])[0]
        m = torch.tensor(s.mask[1:]) > 0
        diffs.append((lp[m] - torch.tensor(s.sampler_logprobs[1:])[m]).abs())
        if s.routes is not None:  # the trainer's own top-k against the server's, where recorded
            mine = torch.stack(own, 1)  # [L, M, K]: one sample, tokens flattened
            theirs = torch.from_numpy(s.routes).long()
            seen = (theirs >= 0).all(-1)
            differ += int(((mine.sort(-1).values != theirs.sort(-1).values).any(-1) & seen).sum())
            routed += int(seen.sum())
    for h in hooks:
        h.remove()
    d = torch.cat(diffs)
    return {"tokens": int(d.numel()), "gap_max": float(d.max()), "gap_mean": float(d.mean()),
            "gap_p99": float(d.quantile(0.99)), "routes": routed, "routes_differ": differ}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="serve/builtin/composer-tiny")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--base", type=int, default=50_000, help="first bugfix seed")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", default="bench/routing-replay/results.json")
    args = ap.parse_args(argv)
    from agent.tasks.families import generate

    model = Path(args.model)
    tasks = [generate("bugfix", seed, "small") for seed in range(args.base, args.base + args.tasks)]
    results = {"model": str(model), "tasks": [t.id for t in tasks], "by_dtype": {}}
    for dtype in args.dtypes.split(","):
        t0 = time.monotonic()
        samples = rollouts(model, dtype, tasks, args.max_tokens)
        results["by_dtype"][dtype] = {"own routing": gaps(model, samples, replay=False),
                                      "replayed": gaps(model, samples, replay=True),
                                      "seconds": round(time.monotonic() - t0, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print("\n| server dtype | trainer routing | sampled tokens | gap max | gap p99 | gap mean | routes the trainer "
          "would pick otherwise |\n| --- | --- | --- | --- | --- | --- | --- |")
    for dtype, r in results["by_dtype"].items():
        for how in ("own routing", "replayed"):
            g = r[how]
            print(f"| {dtype} | {how} | {g['tokens']} | {g['gap_max']:.2e} | {g['gap_p99']:.2e} | {g['gap_mean']:.2e} "
                  f"| {g['routes_differ']} of {g['routes']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
