"""Greedy speculative decoding simulated without the model: how many tokens each drafter would have had
accepted on the replayed requests, from their greedy outputs.

    python bench/spec_sim.py [--sets agent stdlib edit expert random] [--k 1 2 4 8 16] [--outputs FILE]

Under greedy decoding acceptance needs no model: a verify step keeps the longest prefix of the draft
that equals the greedy continuation, plus the one token the step computes. So, given each request's
prompt ids and its greedy output (decoded once with speculation off: `--outputs`, made by this script
through the native engine when missing, and the same tokens every run), each drafter is replayed token
by token exactly as the engine's Speculator calls it (`serve.engine.speculation.propose`: the request's
own text, the cross-request cache of earlier requests' outputs, warmed as bench/spec.py warms it on
another set), for a fixed draft length k: every proposal verified. It reports tokens per forward and
the accepted share by kind of text (bench/spec.token_kinds), and the speedup those would give at
batch 1 with the step costs measured on the engine (`--costs`: decode step and verify steps of 2/4/8
drafts, milliseconds), for a quick comparison of drafters before the real, timed replay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.spec import RANDOM_WEIGHTS, SETS, WARM_REQUESTS, WARM_TOKENS, load_set, token_kinds  # noqa: E402


def greedy_outputs(model_dir: str, sets: dict, stops: list[int]) -> dict[str, list[int]]:
    from bench.spec import replay
    from serve.engine.native import EngineConfig, NativeEngine

    engine = NativeEngine(model_dir, EngineConfig(dtype="float64", speculative="off", max_num_seqs=8))
    try:
        out = {}
        for reqs in sets.values():
            results, _ = asyncio.run(replay(engine, reqs, 0.0, 8, stops))
            out.update({r["id"]: r["ids"] for r in results})
        return out
    finally:
        asyncio.run(engine.stop())


DEFAULT_COSTS = "3.5,4.6,5.6,6.05,6.5,6.7,6.9,7.15,7.4"
"""Milliseconds of a batch-1 step verifying 0..8 draft tokens: measured on the engine's model runner at
2/4/8 (BENCHMARKS.md, "Speculative decoding"), the others interpolated; beyond 8, +0.25 ms a token."""


def step_ms(costs: list[float], extra: int) -> float:
    return costs[extra] if extra < len(costs) else costs[-1] + 0.25 * (extra - len(costs) + 1)


def simulate(reqs, outputs: dict[str, list[int]], warm, k: int, method: str, kinds: dict | None = None,
             warm_tokens: int = WARM_TOKENS, misses: list | None = None, adaptive: bool = False,
             costs: list[float] | None = None, prefill_row_ms: float | None = None) -> dict:
    """Replay greedy decoding of `reqs` one after the other (batch 1) through the engine's Speculator
    (its plan: every proposal up to k tokens, or with `adaptive` the cost model's choice, fed the step
    costs `costs` as the engine feeds it its timings); the cache first holds the warm requests' first
    `warm_tokens` tokens. Speedup: the decode steps' time (after each first token) without drafts over
    that with them, at those costs. With `prefill_row_ms`, each prompt's opening is drafted too (as the
    engine's planner drafts it, a draft row priced at that many ms) and verified in the prefill: its kept
    tokens are counted apart (`from_prefill`); `speedup` then counts them as decode tokens (each one
    decode step saved, its draft rows' time spent), `decode_steps_speedup` leaves them out."""
    from serve.engine.base import SamplingParams
    from serve.engine.drafter import DraftCache, SpecConfig
    from serve.engine.sequence import Sequence
    from serve.engine.speculation import Speculator

    costs = costs or [float(x) for x in DEFAULT_COSTS.split(",")]
    spec = Speculator(SpecConfig(method, min(k, 64), adaptive=adaptive), max_model_len=1 << 20)
    if spec.cache is not None:
        for r in warm:
            spec.cache.add("", r.ids[-DraftCache.PROMPT_TAIL:], outputs[r.id][:warm_tokens])
    if prefill_row_ms is not None:  # the prefill's row cost and a plain step, as the engine observes them
        spec.cost.observe(1, costs[0] / 1000, seqs=1)
        spec.cost.observe_prefill(1000, prefill_row_ms)
    tokens = accepted = drafted = forwards = from_prefill = 0
    plain_ms = spec_ms = 0.0  # decode steps: without drafts, with them
    pre_plain_ms = pre_spec_ms = 0.0  # the prefill drafts: decode steps their kept tokens saved, their rows
    by_kind: dict[str, list[int]] = {}
    for r in reqs:
        out = outputs[r.id]
        seq = Sequence(list(r.ids) + out[:1], SamplingParams(max_tokens=max(r.max_tokens, len(out))))
        seq.num_prompt_tokens = len(r.ids)
        p, forwards = 1, forwards + 1  # the first token comes from the prefill
        acc_flags = [0] * len(out)
        if prefill_row_ms is not None:
            seq.token_ids, seq.num_computed = list(r.ids), 0
            spec.plan([], [seq])
            draft = seq.draft
            a = 0
            while a < len(draft) and a + 1 < len(out) and draft[a] == out[a]:
                a += 1
            if draft:
                spec.verified(seq, len(draft), a)
            drafted += len(draft)
            accepted += a
            from_prefill += a
            pre_plain_ms += costs[0] * a
            pre_spec_ms += prefill_row_ms * len(draft)
            for i in range(a):
                acc_flags[1 + i] = 1
            p = 1 + a
            seq.token_ids += out[:p]
            seq.draft = []
        while p < len(out):
            seq.num_computed = len(seq) - 1
            spec.plan([seq])
            draft = seq.draft
            a = 0
            while a < len(draft) and p + a < len(out) and draft[a] == out[p + a]:
                a += 1
            if draft:
                spec.verified(seq, len(draft), a)
            if misses is not None and a < len(draft):
                misses.append((r.id, seq.token_ids[-12:], draft[a:], out[p + a : p + a + 8], 0))
            ms = step_ms(costs, len(draft))
            spec.cost.observe(1 + len(draft), ms / 1000, seqs=1)
            plain_ms += costs[0] * min(a + 1, len(out) - p)
            spec_ms += ms
            for i in range(min(a, len(out) - p)):
                acc_flags[p + i] = 1
            drafted += len(draft)
            accepted += min(a, len(out) - p - 1)
            forwards += 1
            step = min(a + 1, len(out) - p)
            seq.token_ids += out[p : p + step]
            seq.draft = []
            p += step
        tokens += len(out)
        spec.finished(seq)
        if kinds is not None:
            for kind, f in zip(kinds[r.id], acc_flags, strict=True):
                d = by_kind.setdefault(kind, [0, 0])
                d[0] += 1
                d[1] += f
    return {"tokens": tokens, "accepted": accepted, "drafted": drafted, "forwards": forwards,
            "tok_per_forward": tokens / max(forwards, 1), "accepted_of_drafted": accepted / max(drafted, 1),
            "speedup": (plain_ms + pre_plain_ms) / max(spec_ms + pre_spec_ms, 1e-9), "from_prefill": from_prefill,
            "decode_steps_speedup": plain_ms / max(spec_ms, 1e-9),
            "kinds": {kd: {"tokens": t, "tok_per_forward": t / max(t - a, 1)} for kd, (t, a) in by_kind.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=Path, default=ROOT / "bench" / "spec-results" / "sessions")
    sim_sets = [s for s in SETS if s not in RANDOM_WEIGHTS]  # the built-in model's greedy outputs only
    p.add_argument("--sets", nargs="+", default=sim_sets, choices=sim_sets)
    p.add_argument("--k", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--methods", nargs="+", default=["ngram", "suffix"])
    p.add_argument("--outputs", type=Path, default=ROOT / "bench" / "spec-results" / "greedy-outputs.json")
    p.add_argument("--kinds", action="store_true", help="split tokens per forward by kind of text")
    p.add_argument("--warm-requests", type=int, default=WARM_REQUESTS,
                   help="requests of the next set whose outputs are in the cache first (as bench/spec.py --warm-requests)")
    p.add_argument("--adaptive", action="store_true", help="the cost model's drafts, not every proposal")
    p.add_argument("--costs", default=DEFAULT_COSTS, help="ms of a batch-1 step verifying 0, 1, 2, ... draft tokens")
    p.add_argument("--warm-tokens", type=int, default=WARM_TOKENS, help="tokens of each warm request's output")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--prefill-row-ms", type=float,
                   help="draft each prompt's opening too, verified in its prefill at this many ms a draft row")
    args = p.parse_args()

    from serve.chat_format import ChatFormat
    from serve.cli import BUILTIN_DIR
    from serve.model.config import ModelConfig

    model_dir = str(BUILTIN_DIR)
    chat = ChatFormat(model_dir)
    max_model_len = ModelConfig.from_dir(model_dir).max_position_embeddings
    every = {s: load_set(s, args.sessions, chat, max_model_len, None) for s in SETS
             if s == "random" or (args.sessions / s).is_dir()}
    outputs = json.loads(args.outputs.read_text()) if args.outputs.is_file() else {}
    todo = {s: [r for r in reqs if r.id not in outputs] for s, reqs in every.items()}
    if any(todo.values()):
        print(f"decoding {sum(map(len, todo.values()))} requests greedily (speculation off) into {args.outputs}", flush=True)
        outputs.update(greedy_outputs(model_dir, {s: r for s, r in todo.items() if r}, chat.stop_token_ids))
        args.outputs.write_text(json.dumps(outputs, separators=(",", ":")))
    names = [s for s in SETS if s in every]
    rows = []
    for s in args.sets:
        if s not in every:
            continue
        reqs = every[s]
        warm = every[names[(names.index(s) + 1) % len(names)]][: args.warm_requests]
        kinds = {r.id: token_kinds(chat, outputs[r.id], r.in_reasoning) for r in reqs} if args.kinds else None
        for method in args.methods:
            for k in args.k:
                res = simulate(reqs, outputs, warm, k, method, kinds, args.warm_tokens, adaptive=args.adaptive,
                               costs=[float(x) for x in args.costs.split(",")], prefill_row_ms=args.prefill_row_ms)
                rows.append({"set": s, "method": method, "k": k, **res})
                kd = "; ".join(f"{n} {d['tok_per_forward']:.2f} ({d['tokens']})" for n, d in sorted(res["kinds"].items()))
                print(f"{s:7s} {method:6s} k={k:2d}: {res['tok_per_forward']:.2f} tok/fwd, "
                      f"{res['accepted_of_drafted']:.0%} of {res['drafted']} drafted accepted, {res['tokens']} tokens, "
                      f"{res['speedup']:.2f}x at those step costs"
                      + (f" ({res['from_prefill']} tokens from prefills; decode steps alone "
                         f"{res['decode_steps_speedup']:.2f}x)" if args.prefill_row_ms is not None else "")
                      + (f"  [{kd}]" if kd else ""), flush=True)
    if args.json:
        meta = {"command": " ".join(["bench/spec_sim.py", *sys.argv[1:]]), "adaptive": args.adaptive,
                "costs_ms": args.costs, "prefill_row_ms": args.prefill_row_ms, "warm_requests": args.warm_requests, "warm_tokens": args.warm_tokens}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
