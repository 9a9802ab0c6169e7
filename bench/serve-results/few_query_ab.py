"""A float64 step's few-query attention in C++ (kernels/csrc/few_query_attention_cpu.cpp, now: B) against the
torch path that gathers the pages and runs two batched matmuls (before: A): one step of the built-in model
(float64, one thread) at 1-9 query rows of one sequence (a decode, or a draft verified) after CONTEXT tokens,
alternating A and B step by step in one process; their log-probs agree to 1e-9 (checked every step). Issue 50
(BENCHMARKS, speculative decoding). Usage: python bench/serve-results/few_query_ab.py N_STEPS [CONTEXT ...]."""

# ruff: noqa: E402 (the repository root goes on sys.path first)
import asyncio
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import torch

torch.set_num_threads(1)
from kernels import cpu_ext
from serve.cli import BUILTIN_DIR
from serve.engine.base import SamplingParams
from serve.engine.native import EngineConfig, NativeEngine
from serve.engine.sequence import Sequence

kernel = cpu_ext.build().few_query_attention
E = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8))
rng = random.Random(0)
ROWS = (1, 2, 3, 5, 9)
for context in [int(x) for x in sys.argv[2:]] or [1400]:
    s = Sequence([rng.randrange(10, 4000) for _ in range(context)], SamplingParams(max_tokens=64))
    E.blocks.allocate(s)
    E.runner.run([(s, context)])
    s.num_computed = context
    s.token_ids.append(5)
    E.blocks.ensure(s, context + 20)
    res = {(m, r): [] for m in "AB" for r in ROWS}
    for i in range(int(sys.argv[1])):
        for r in ROWS:
            draft = [rng.randrange(10, 4000) for _ in range(r - 1)]
            out = {}
            for m in "AB" if i % 2 else "BA":
                E.runner.few_query_kernel = kernel if m == "B" else None
                s.draft = list(draft)
                t = time.thread_time()
                _, lg = E.runner.run([(s, r)])
                out[m] = torch.log_softmax(lg, -1)
                if i >= 3:
                    res[(m, r)].append(time.thread_time() - t)
            assert (out["A"] - out["B"]).abs().max() < 1e-9
    for r in ROWS:
        a, b = res[("A", r)], res[("B", r)]
        print(f"context {context}, rows {r}: before {statistics.median(a) * 1e3:.2f} ms (min {min(a) * 1e3:.2f}), now "
              f"{statistics.median(b) * 1e3:.2f} ms (min {min(b) * 1e3:.2f}): {statistics.median(b) / statistics.median(a):.3f}x",
              flush=True)
    E.blocks.free(s)
asyncio.run(E.stop())
