"""The LM head on a CPU as W·hᵀ through GEMM (now, B) against F.linear (before, A): one step of the built-in
model (float64, one thread, a 1,400-token context) at 1-9 query rows of one sequence (a decode, or a draft
verified), alternating A and B step by step in one process; log-probs of the two agree to 1e-9. Issue 50
(BENCHMARKS, speculative decoding). Usage: python bench/serve-results/lm_head_ab.py N_STEPS."""

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
import torch.nn.functional as F

torch.set_num_threads(1)
import serve.model.qwen3_moe as qm
from serve.cli import BUILTIN_DIR
from serve.engine.base import SamplingParams
from serve.engine.native import EngineConfig, NativeEngine
from serve.engine.sequence import Sequence

now = qm.Qwen3MoeModel.logits
arm = {"v": "B"}


def logits(self, h):
    return F.linear(h, self.lm_head.weight) if arm["v"] == "A" else now(self, h)


qm.Qwen3MoeModel.logits = logits
E = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8))
rng = random.Random(0)
s = Sequence([rng.randrange(10, 4000) for _ in range(1400)], SamplingParams(max_tokens=64))
E.blocks.allocate(s)
E.runner.run([(s, 1400)])
s.num_computed = 1400
s.token_ids.append(5)
E.blocks.ensure(s, 1420)
ROWS = (1, 2, 3, 5, 9)
res = {(m, r): [] for m in "AB" for r in ROWS}
for i in range(int(sys.argv[1])):
    for r in ROWS:
        draft = [rng.randrange(10, 4000) for _ in range(r - 1)]
        out = {}
        for m in "AB" if i % 2 else "BA":
            arm["v"] = m
            s.draft = list(draft)
            t = time.thread_time()
            _, lg = E.runner.run([(s, r)])
            out[m] = torch.log_softmax(lg, -1)
            if i >= 3:
                res[(m, r)].append(time.thread_time() - t)
        assert (out["A"] - out["B"]).abs().max() < 1e-9
for r in ROWS:
    a, b = res[("A", r)], res[("B", r)]
    print(f"rows {r}: before {statistics.median(a) * 1e3:.2f} ms (min {min(a) * 1e3:.2f}), now "
          f"{statistics.median(b) * 1e3:.2f} ms (min {min(b) * 1e3:.2f}): {statistics.median(b) / statistics.median(a):.3f}x")
asyncio.run(E.stop())
