"""A float64 step with its C++ kernels (now: B; kernels/csrc/few_query_attention_cpu.cpp, the few-query
attention reading the pages in place, and kernels/csrc/moe_f64_cpu.cpp, the experts' few rows) against the
torch paths (before: A; the attention `ARMS=attention` or the experts `ARMS=experts` alone with the kernel
in both arms otherwise): one step of the built-in model (float64, one thread) at 1-9 query rows of one
sequence (a decode, or a draft verified) after CONTEXT tokens, alternating A and B step by step in one
process; their log-probs agree to 1e-9 (checked every step). Issue 50 (BENCHMARKS, speculative decoding).
Usage: [ARMS=both|attention|experts] python bench/serve-results/f64_kernels_ab.py N_STEPS [CONTEXT ...]."""

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

module = cpu_ext.build()
E = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8))
ARMS = os.environ.get("ARMS", "both")


def use(m: str) -> None:
    """Arm B: the kernels; arm A: torch's path for what ARMS names, the kernel for the rest."""
    E.runner.few_query_kernel = module.few_query_attention if m == "B" or ARMS == "experts" else None
    for moe in E.model.moe_layers():
        moe.cpu_kernels = module if m == "B" or ARMS == "attention" else None  # kernels/moe.py few_rows_f64


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
                use(m)
                s.draft = list(draft)
                t = time.thread_time()
                _, lg = E.runner.run([(s, r)])
                out[m] = torch.log_softmax(lg, -1)
                if i >= 3:
                    res[(m, r)].append(time.thread_time() - t)
            assert (out["A"] - out["B"]).abs().max() < 1e-9
    for r in ROWS:
        a, b = res[("A", r)], res[("B", r)]
        print(f"{ARMS}: context {context}, rows {r}: before {statistics.median(a) * 1e3:.2f} ms (min {min(a) * 1e3:.2f}), now "
              f"{statistics.median(b) * 1e3:.2f} ms (min {min(b) * 1e3:.2f}): {statistics.median(b) / statistics.median(a):.3f}x",
              flush=True)
    E.blocks.free(s)
asyncio.run(E.stop())
