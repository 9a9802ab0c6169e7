"""The LM head on a CPU as W·hᵀ through GEMM (now, B) against F.linear (before, A): one step of the built-in
model (float64, one thread, a 1,400-token context) at 1-9 query rows of one sequence (a decode, or a draft
verified), alternating A and B step by step in one process; log-probs of the two agree to 1e-9. Issue 50
(BENCHMARKS, speculative decoding). Usage: python bench/serve-results/lm_head_ab.py N_STEPS."""

# ruff: noqa: E402 (the repository root goes on sys.path first)
import asyncio
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
import serve.model.qwen3_moe as qm
from bench.step_ab import step_ab
from serve.cli import BUILTIN_DIR
from serve.engine.native import EngineConfig, NativeEngine

now = qm.Qwen3MoeModel.logits
arm = {"v": "B"}


def logits(self, h):
    return F.linear(h, self.lm_head.weight) if arm["v"] == "A" else now(self, h)


qm.Qwen3MoeModel.logits = logits
E = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8))
step_ab(E, lambda m: arm.update(v=m), int(sys.argv[1]), [1400])
asyncio.run(E.stop())
