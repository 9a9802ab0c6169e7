"""Speculation against none, request by request: two engines in one process, each request decoded by one and
then the other (the order alternating), decode-only tokens/s summed over the set.

    python bench/spec_ab.py [--set norepeat] [--method suffix] [--temperature 0] [--limit N] [--json OUT]

bench/spec.py runs whole sets one method after another (~10 s a run at batch 1), so a machine that drifts
by a few percent over a minute moves its ratios by as much: on the `norepeat` set, where nothing can be
accepted, its batch-1 cells read 0.89x-1.13x from run to run. Here the two engines see each request back
to back, so drift cancels request by request. Each engine serves each request once (a second time, the
suffix drafter's cache would hold its output) after the same warm-up as bench/spec.py (4 requests of
another set, 48 tokens each). Greedy outputs are checked identical (exit 1 otherwise). Batch 1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.spec import RANDOM_WEIGHTS, SETS, WARM_REQUESTS, WARM_TOKENS, load_set, replay  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default="norepeat", choices=SETS)
    p.add_argument("--method", default="suffix", choices=("ngram", "suffix"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--limit", type=int, help="requests at most")
    p.add_argument("--sessions", type=Path, default=ROOT / "bench" / "spec-results" / "sessions")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # as bench/spec.py: one torch thread, before torch starts its pool
    import torch

    torch.set_num_threads(1)
    from serve.chat_format import ChatFormat
    from serve.cli import BUILTIN_DIR
    from serve.engine.native import EngineConfig, NativeEngine
    from serve.model.config import ModelConfig

    model_dir = str(BUILTIN_DIR)
    chat = ChatFormat(model_dir)
    max_len = ModelConfig.from_dir(model_dir).max_position_embeddings
    reqs = load_set(args.set, args.sessions, chat, max_len, args.limit)
    other = SETS[(SETS.index(args.set) + 1) % len(SETS)]
    warm = load_set(other, args.sessions, chat, max_len, WARM_REQUESTS)
    fmt = "dummy" if args.set in RANDOM_WEIGHTS else "auto"
    methods = ("off", args.method)
    engines = {m: NativeEngine(model_dir, EngineConfig(dtype="float64", speculative=m, max_num_seqs=8, load_format=fmt))
               for m in methods}
    stops = chat.stop_token_ids
    decode_s = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    ids: dict[str, dict[str, list[int]]] = {m: {} for m in methods}
    try:
        for e in engines.values():
            asyncio.run(replay(e, warm, args.temperature, 1, stops, WARM_TOKENS))
        for i, r in enumerate(reqs):
            for m in methods if i % 2 == 0 else methods[::-1]:
                (out,), _ = asyncio.run(replay(engines[m], [r], args.temperature, 1, stops))
                ids[m][r.id] = out["ids"]
                if out["tokens"] > 1:
                    decode_s[m] += out["time_s"] - out["ttft_s"]
                    tokens[m] += out["tokens"] - 1
            print(f"\r{i + 1}/{len(reqs)} requests", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    finally:
        for e in engines.values():
            asyncio.run(e.stop())
    rate = {m: tokens[m] / max(decode_s[m], 1e-9) for m in methods}
    differ = [k for k in ids["off"] if ids["off"][k] != ids[args.method][k]]
    result = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "set": args.set,
              "method": args.method, "temperature": args.temperature, "requests": len(reqs),
              "decode_tok_s": rate, "tokens": tokens, "ratio": rate[args.method] / rate["off"],
              "load_avg": os.getloadavg(), "greedy_differ": differ if args.temperature == 0 else None}
    print(f"{args.set}, T={args.temperature:g}, batch 1, {len(reqs)} requests: decode tok/s off {rate['off']:.1f}, "
          f"{args.method} {rate[args.method]:.1f}: {result['ratio']:.3f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.temperature == 0 and differ:
        print(f"greedy outputs differ on {len(differ)} requests: {differ[:5]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
