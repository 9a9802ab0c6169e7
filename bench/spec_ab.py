"""Speculation against none, request by request: two engines in one process, each request decoded by one and
then the other (the order alternating), decode-only tokens/s summed over the set.

    python bench/spec_ab.py [--set norepeat] [--method suffix] [--temperature 0] [--limit N] [--json OUT]
                            [--no-prefill | --against no-prefill] [--concurrency 8]

bench/spec.py runs whole sets one method after another (~10 s a run at batch 1), so a machine that drifts
by a few percent over a minute moves its ratios by as much: on the `norepeat` set, where nothing can be
accepted, its batch-1 cells read 0.89x-1.13x from run to run. Here the two engines see each request back
to back, so drift cancels request by request. Each engine serves each request once (a second time, the
suffix drafter's cache would hold its output) after the same warm-up as bench/spec.py (4 requests of
another set, 48 tokens each). Greedy outputs are checked identical (exit 1 otherwise).

`--concurrency N` pairs groups instead of requests: each group of N requests is served by one engine at
batch N and then by the other, the order alternating, and the figure is tokens over the groups' summed wall
time (with the median of the groups' own ratios beside it): batch-N throughput with drift cancelled group by group.

Three figures: decode-only tokens/s (every token after a request's first, over the time after it); the
same for the decode steps alone (the tokens a prefill's forward kept from a draft left out: a prefill
that verifies a draft hands over several tokens at once, and those are not the decode steps' work);
and how much shorter the requests' whole time is. `--against no-prefill` compares the method with
itself without prefill drafts (`--no-prefill`: the method without them, against off).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.spec import RANDOM_WEIGHTS, SETS, WARM_REQUESTS, WARM_TOKENS, first_forward, load_set, replay  # noqa: E402


def _counts(engine) -> tuple[int, int, int]:
    spec = engine.spec
    return (spec.drafted, spec.accepted, spec.verifies) if spec is not None else (0, 0, 0)


def _drafts(d: list[int]) -> str:
    return f"{d[0]} tokens drafted in {d[2]} verifications, {d[1]} accepted"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default="norepeat", choices=SETS)
    p.add_argument("--method", default="suffix", choices=("ngram", "suffix"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--limit", type=int, help="requests at most")
    p.add_argument("--sessions", type=Path, default=ROOT / "bench" / "spec-results" / "sessions")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--warm-requests", type=int, default=WARM_REQUESTS,
                   help="requests of the next set served first, their outputs in the drafter's cache")
    p.add_argument("--warm-tokens", type=int, default=WARM_TOKENS, help="max_tokens of each warm-up request")
    p.add_argument("--no-prefill", action="store_true", help="speculate in decode steps only (no draft in prefills)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="above 1: groups of this many requests served together, paired group by group")
    p.add_argument("--against", choices=("off", "no-prefill"), default="off",
                   help="the engine compared with: no speculation, or the same method without prefill drafts")
    args = p.parse_args()
    if args.concurrency < 1:
        p.error(f"--concurrency: a batch of at least 1 request, not {args.concurrency}")
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
    warm = load_set(other, args.sessions, chat, max_len, args.warm_requests)
    fmt = "dummy" if args.set in RANDOM_WEIGHTS else "auto"
    # name -> (speculative method, prefill drafts): the engine compared with, then the method measured
    arms = {"off": ("off", False)} if args.against == "off" else {f"{args.method}-no-prefill": (args.method, False)}
    arms[args.method] = (args.method, not args.no_prefill)
    methods = tuple(arms)
    engines = {m: NativeEngine(model_dir, EngineConfig(dtype="float64", speculative=spec, speculative_prefill=prefill,
                                                       max_num_seqs=max(8, args.concurrency), load_format=fmt))
               for m, (spec, prefill) in arms.items()}
    stops = chat.stop_token_ids
    decode_s = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    from_prefill = dict.fromkeys(methods, 0)  # tokens a prefill's forward kept from a draft
    request_s = dict.fromkeys(methods, 0.0)
    group_s: dict[str, list[float]] = {m: [] for m in methods}  # each group's wall time, and its tokens
    group_tokens: dict[str, list[int]] = {m: [] for m in methods}
    ids: dict[str, dict[str, list[int]]] = {m: {} for m in methods}
    try:
        for e in engines.values():
            asyncio.run(replay(e, warm, args.temperature, 1, stops, args.warm_tokens))
        # the measured arm's drafting counters after the warm-up: what its drafts cost and kept on this set
        spec0 = {m: _counts(e) for m, e in engines.items()}
        n = args.concurrency
        groups = [reqs[i:i + n] for i in range(0, len(reqs), n)]
        for i, group in enumerate(groups):
            for m in methods if i % 2 == 0 else methods[::-1]:
                outs, wall = asyncio.run(replay(engines[m], group, args.temperature, n, stops))
                group_s[m].append(wall)
                group_tokens[m].append(sum(o["tokens"] for o in outs))
                for r, out in zip(group, outs, strict=True):
                    ids[m][r.id] = out["ids"]
                    request_s[m] += out["time_s"]
                    if out["tokens"] > 1:
                        decode_s[m] += out["time_s"] - out["ttft_s"]
                        tokens[m] += out["tokens"] - 1
                        from_prefill[m] += first_forward(out["accepted"]) - 1
            print(f"\r{i + 1}/{len(groups)} groups of {n}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        drafts = {m: [b - a for a, b in zip(spec0[m], _counts(e), strict=True)] for m, e in engines.items()}
    finally:
        for e in engines.values():
            asyncio.run(e.stop())
    m0, m1 = methods
    rate = {m: tokens[m] / max(decode_s[m], 1e-9) for m in methods}
    steps_rate = {m: (tokens[m] - from_prefill[m]) / max(decode_s[m], 1e-9) for m in methods}
    differ = [k for k in ids[m0] if ids[m0][k] != ids[m1][k]]
    # throughput at the batch served: all tokens over the groups' wall time, and each group's own ratio
    tput = {m: sum(group_tokens[m]) / max(sum(group_s[m]), 1e-9) for m in methods}
    per_group = [(t1 / w1) / (t0 / w0) for t0, w0, t1, w1 in
                 zip(group_tokens[m0], group_s[m0], group_tokens[m1], group_s[m1], strict=True) if t0 and w0 and w1]
    result = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "set": args.set,
              "method": args.method, "against": m0, "warm": [other, len(warm), args.warm_tokens], "prefill_drafts": not args.no_prefill,
              "temperature": args.temperature, "requests": len(reqs), "concurrency": n,
              "tok_s": tput, "tok_s_ratio": tput[m1] / tput[m0],
              "group_ratios": [round(x, 4) for x in per_group],
              "group_ratio_median": statistics.median(per_group) if per_group else None,
              "decode_tok_s": rate, "tokens": tokens, "ratio": rate[m1] / rate[m0],
              # without the tokens prefills kept from drafts: what the decode steps alone made per second
              "decode_steps_tok_s": steps_rate, "from_prefill": from_prefill,
              "decode_steps_ratio": steps_rate[m1] / steps_rate[m0],
              "request_s": request_s, "latency_ratio": request_s[m0] / max(request_s[m1], 1e-9),
              "load_avg": os.getloadavg(), "greedy_differ": differ if args.temperature == 0 else None,
              "drafts": {m: dict(zip(("drafted", "accepted", "verifies"), d, strict=True)) for m, d in drafts.items()}}
    if n == 1:
        print(f"{args.set}, T={args.temperature:g}, batch 1, {len(reqs)} requests: decode tok/s {m0} {rate[m0]:.1f}, "
              f"{m1} {rate[m1]:.1f}: {result['ratio']:.3f}x; decode steps alone {result['decode_steps_ratio']:.3f}x "
              f"({from_prefill[m1]} tokens from prefills); requests' time {result['latency_ratio']:.3f}x shorter; "
              f"{_drafts(drafts[m1])}")
    elif per_group:
        print(f"{args.set}, T={args.temperature:g}, batch {n}, {len(reqs)} requests in {len(groups)} groups: tok/s "
              f"{m0} {tput[m0]:.1f}, {m1} {tput[m1]:.1f}: {result['tok_s_ratio']:.3f}x; median of the groups' "
              f"ratios {result['group_ratio_median']:.3f}x (min {min(per_group):.3f}, max {max(per_group):.3f}); "
              f"{_drafts(drafts[m1])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.temperature == 0 and differ:
        print(f"greedy outputs differ on {len(differ)} requests: {differ[:5]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
