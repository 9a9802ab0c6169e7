"""A projection's few rows on a CPU as W·xᵀ through GEMM (now, B: serve/model/numerics.py `proj`) against
the module's own F.linear (before, A): one step of the built-in model (float64, one thread) at 1-9 query
rows of one sequence (a decode, or a draft verified) after CONTEXT tokens, alternating A and B step by
step in one process; log-probs of the two agree to 1e-9. Issue 50 (BENCHMARKS, speculative decoding).
Usage: python bench/serve-results/proj_ab.py N_STEPS [CONTEXT ...]."""

# ruff: noqa: E402 (the repository root goes on sys.path first)
import asyncio
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import torch

torch.set_num_threads(1)
import serve.model.qwen3_moe as qm
from bench.step_ab import step_ab
from serve.cli import BUILTIN_DIR
from serve.engine.native import EngineConfig, NativeEngine

now = qm.proj
arm = {"v": "B"}


def proj(m, x, exact):
    return m(x) if arm["v"] == "A" and not exact else now(m, x, exact)


qm.proj = proj  # the model's layers call it by this name
E = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8))
step_ab(E, lambda m: arm.update(v=m), int(sys.argv[1]), [int(c) for c in sys.argv[2:]] or [1400])
asyncio.run(E.stop())
