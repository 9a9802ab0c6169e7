"""Train = serve in low precision: the trainer's log-probs against composer-serve's, per dtype and mode.

Real RL rollouts (train/rollout.py: the deployed harness, T=1, episodes run concurrently so the server
batches them and chunks their prefills) of the built-in model on bugfix tasks, served in each dtype, in
the default mode and with --batch-invariant; the trainer then scores the very samples (routing replayed)
in the same dtype and mode, and, as the figure before train=serve, in float32. Prints mean, p99 and max
|Δ log p| over sampled tokens, and the engine's decode throughput in each mode (8 concurrent greedy
requests, in-process, modes alternated and repeated: the machine drifts).

    python bench/train_serve_gap.py [--model serve/builtin/composer-tiny] [--dtypes bfloat16,float16]
        [--tasks 8] [--out bench/train-serve-gap/results.json]
    python bench/train_serve_gap.py --random-prompts    # the issue's 16 random prompts x 48 tokens at T=1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rollouts(model: Path, dtype: str, invariant: bool, tasks, max_tokens: int, workers: int):
    from train.rollout import RolloutConfig, run_episode
    from train.server import launch

    server = launch(model, "--dtype", dtype, *(["--batch-invariant"] if invariant else []), name="policy")
    try:
        cfg = RolloutConfig(server.base_url, "policy", api_key=server.api_key, temperature=1.0,
                            max_output_tokens=max_tokens)
        with ThreadPoolExecutor(workers) as pool:
            eps = list(pool.map(lambda it: run_episode(it[1], it[0], cfg), enumerate(tasks)))
    finally:
        server.stop()
    bad = [ep.infra_error for ep in eps if ep.infra_error]
    if bad:
        raise RuntimeError(bad[0])
    return [s for ep in eps for s in ep.samples]


def random_prompts(model: Path, dtype: str, invariant: bool, cpu_kernels: bool = True):
    """The issue's measurement: 16 random prompts of 20-120 token ids, 48 tokens each sampled at T=1 by the
    in-process engine (all 16 at once, 64 tokens a step: chunked prefills), experts recorded for replay."""
    import numpy as np
    import torch

    from serve.engine.base import SamplingParams
    from serve.engine.native import EngineConfig, NativeEngine
    from train.samples import Sample

    engine = NativeEngine(str(model), EngineConfig(dtype=dtype, batch_invariant=invariant, max_batched_tokens=64,
                                                   kv_cache_tokens=8192, cpu_kernels=cpu_kernels))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2000, (int(n),), generator=g).tolist() for n in torch.randint(20, 120, (16,), generator=g)]

    async def one(p, seed):
        params = SamplingParams(max_tokens=48, temperature=1.0, seed=seed, logprobs=True, return_routed_experts=True)
        s = Sample("random", seed)
        s.extend(p, sampled=False)
        ids, lps = [], []
        async for t in engine.generate(p, params):
            ids.append(t.id)
            lps.append(t.logprob)
            if t.routed_experts is not None:
                routes = np.asarray(t.routed_experts, dtype=np.int16)
        s.extend(ids, sampled=True, logprobs=lps)
        s.add_routes(0, routes)
        return s

    async def all_():
        return await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))

    try:
        return asyncio.run(all_())
    finally:
        asyncio.run(engine.stop())


def gaps(model: Path, samples, dtype: str, invariant: bool) -> dict:
    import torch

    from train.trainer import Trainer, TrainerConfig

    trainer = Trainer(model, TrainerConfig(dtype=dtype, batch_invariant=invariant))
    d = []
    for s, lp in zip(samples, trainer.logprobs(samples), strict=True):
        m = torch.tensor(s.mask[1:]) > 0
        d.append((lp[m] - torch.tensor(s.sampler_logprobs[1:])[m]).abs())
    g = torch.cat(d)
    return {"tokens": int(g.numel()), "mean": float(g.mean()), "p99": float(g.quantile(0.99)), "max": float(g.max()),
            "exact_share": float((g == 0).float().mean())}


def throughput(model: Path, dtype: str, repeats: int = 3) -> dict:
    """Decode tokens/s of 8 concurrent greedy 64-token requests, default vs batch-invariant, alternated."""
    import torch

    from serve.engine.base import SamplingParams
    from serve.engine.native import EngineConfig, NativeEngine

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2000, (48,), generator=g).tolist() for _ in range(8)]
    engines = {mode: NativeEngine(str(model), EngineConfig(dtype=dtype, batch_invariant=mode == "batch-invariant",
                                                            kv_cache_tokens=8192))
               for mode in ("default", "batch-invariant")}

    async def batch(engine) -> int:
        async def one(p):
            n = 0
            async for _ in engine.generate(p, SamplingParams(max_tokens=64, temperature=0.0)):
                n += 1
            return n
        return sum(await asyncio.gather(*(one(p) for p in prompts)))

    best = {mode: 0.0 for mode in engines}
    try:
        for _ in range(repeats):
            for mode, engine in engines.items():
                t0 = time.perf_counter()
                n = asyncio.run(batch(engine))
                best[mode] = max(best[mode], n / (time.perf_counter() - t0))
    finally:
        for engine in engines.values():
            asyncio.run(engine.stop())
    return {"tok_s": {k: round(v, 1) for k, v in best.items()},
            "batch_invariant_cost": round(best["default"] / best["batch-invariant"], 2)}


def print_rows(rows: list[dict]) -> None:
    print("\n| server | trainer | sampled tokens | mean |Δ log p| | p99 | max | bit-equal |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['server']} | {r['trainer']} | {r['tokens']} | {r['mean']:.2e} | {r['p99']:.2e} | {r['max']:.2e} "
              f"| {r['exact_share']:.1%} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="serve/builtin/composer-tiny")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4, help="episodes at once")
    ap.add_argument("--base", type=int, default=50_000, help="first bugfix seed")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--random-prompts", action="store_true",
                    help="instead of episodes: random prompts sampled in-process (the issue's measurement), with the "
                         "engine's C++ kernels and without (its torch paths)")
    ap.add_argument("--out", default="bench/train-serve-gap/results.json")
    args = ap.parse_args(argv)
    if args.random_prompts:
        rows = []
        for dtype in args.dtypes.split(","):
            for server, kernels, invariant in (("default", True, False), ("torch paths", False, False),
                                               ("batch-invariant", False, True)):
                samples = random_prompts(Path(args.model), dtype, invariant, kernels)
                trainers = [(dtype, invariant)] + ([("float32", False)] if not invariant else [])
                for t_dtype, t_inv in trainers:
                    rows.append({"server": f"{dtype} {server}", "trainer": f"{t_dtype} {'batch-invariant' if t_inv else 'default'}",
                                 **gaps(Path(args.model), samples, t_dtype, t_inv)})
                    print(json.dumps(rows[-1]), flush=True)
        out = Path(args.out).with_name("random-prompts.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
        print_rows(rows)
        return 0
    from agent.tasks.families import generate

    model = Path(args.model)
    tasks = [generate("bugfix", seed, "small") for seed in range(args.base, args.base + args.tasks)]
    results: dict = {"model": str(model), "tasks": len(tasks), "rows": [], "throughput": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes.split(","):
        for invariant in (False, True):
            samples = rollouts(model, dtype, invariant, tasks, args.max_tokens, args.workers)
            mode = "batch-invariant" if invariant else "default"
            results["rows"].append({"server": f"{dtype} {mode}", "trainer": f"{dtype} {mode}",
                                    **gaps(model, samples, dtype, invariant)})
            if not invariant:  # before train=serve: the trainer in float32 whatever the server ran
                results["rows"].append({"server": f"{dtype} {mode}", "trainer": "float32 default",
                                        **gaps(model, samples, "float32", False)})
            print(json.dumps(results["rows"][-1]), flush=True)
        results["throughput"][dtype] = throughput(model, dtype)
        print(dtype, results["throughput"][dtype], flush=True)
        out.write_text(json.dumps(results, indent=1))
    print_rows(results["rows"])
    print("\n| dtype | default tok/s | batch-invariant tok/s | cost |\n| --- | --- | --- | --- |")
    for dtype, t in results["throughput"].items():
        print(f"| {dtype} | {t['tok_s']['default']} | {t['tok_s']['batch-invariant']} | {t['batch_invariant_cost']}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
