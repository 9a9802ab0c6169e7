"""A step of the built-in model (float64, CPU, 1 thread) at 1-9 query rows of one sequence (a decode, or a
draft verified), old paths (q/k/v unfused, flash attention: A) against now (B), alternating in one process.
SPLIT=1 also splits experts / attention / LM head. Issue 50 (BENCHMARKS, speculative decoding). Usage: N steps."""

# ruff: noqa: E402 (the repository root goes on sys.path first)
import asyncio
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
import torch

torch.set_num_threads(1)
import serve.model.layers as layers
import serve.model.qwen3_moe as q

spent = {}


def timed(fn, key):
    def w(*a, **k):
        t = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            spent[key] = spent.get(key, 0) + time.thread_time() - t

    return w


if os.environ.get("SPLIT"):
    q.SparseMoE.forward = timed(q.SparseMoE.forward, "moe")
    q.Attention.forward = timed(q.Attention.forward, "attn")
    q.Qwen3MoeModel.logits = timed(q.Qwen3MoeModel.logits, "lmhead")
from serve.cli import BUILTIN_DIR
from serve.engine.base import SamplingParams
from serve.engine.native import EngineConfig, NativeEngine
from serve.engine.sequence import Sequence

A = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8, cpu_pack=False))
B = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8))
few = layers.FEW_QUERIES
rng = random.Random(0)
PROMPT = [rng.randrange(10, 4000) for _ in range(500)]


def make(eng):
    s = Sequence(list(PROMPT), SamplingParams(max_tokens=64))
    eng.blocks.allocate(s)
    eng.runner.run([(s, 500)])
    s.num_computed = 500
    s.token_ids.append(5)
    eng.blocks.ensure(s, 516)
    return s


seqs = {"A": make(A), "B": make(B)}
ROWS = [1, 2, 4, 8, 9]
res = {(n, R): [] for n in "AB" for R in ROWS}
for i in range(int(sys.argv[1])):
    for R in ROWS:
        draft = [rng.randrange(10, 4000) for _ in range(R - 1)]
        outs = {}
        for n, eng in (("A", A), ("B", B)):
            layers.FEW_QUERIES = 0 if n == "A" else few
            s = seqs[n]
            s.draft = list(draft)
            spent.clear()
            t = time.thread_time()
            _, logits = eng.runner.run([(s, R)])
            lp = torch.log_softmax(logits, -1)
            lp.argmax(-1)
            dt = time.thread_time() - t
            outs[n] = lp
            if i >= 3:
                res[(n, R)].append(dt)
                for k, v in spent.items():
                    res.setdefault((n, R, k), []).append(v)
        d = (outs["A"] - outs["B"]).abs().max().item()
        assert d < 1e-9 and torch.equal(outs["A"].argmax(-1), outs["B"].argmax(-1)), d
for R in ROWS:
    a, b = res[("A", R)], res[("B", R)]
    print(
        f"rows {R}: A med {statistics.median(a) * 1e3:.2f} min {min(a) * 1e3:.2f} | B med {statistics.median(b) * 1e3:.2f} min {min(b) * 1e3:.2f} ms | B/A med {statistics.median(b) / statistics.median(a):.2f}"
    )
    for k in ("moe", "attn", "lmhead"):
        if ("A", R, k) in res:
            a, b = res[("A", R, k)], res[("B", R, k)]
            print(
                f"    {k}: A med {statistics.median(a) * 1e3:.2f} min {min(a) * 1e3:.2f} | B med {statistics.median(b) * 1e3:.2f} min {min(b) * 1e3:.2f}"
            )
asyncio.run(A.stop())
asyncio.run(B.stop())
