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
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import torch

torch.set_num_threads(1)
from bench.step_ab import step_ab
from kernels import cpu_ext
from serve.cli import BUILTIN_DIR
from serve.engine.native import EngineConfig, NativeEngine

module = cpu_ext.build()
E = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8))
ARMS = os.environ.get("ARMS", "both")


def use(m: str) -> None:
    """Arm B: the kernels; arm A: torch's path for what ARMS names, the kernel for the rest."""
    E.runner.few_query_kernel = module.few_query_attention if m == "B" or ARMS == "experts" else None
    for moe in E.model.moe_layers():
        moe.cpu_kernels = module if m == "B" or ARMS == "attention" else None  # kernels/moe.py few_rows_f64


step_ab(E, use, int(sys.argv[1]), [int(x) for x in sys.argv[2:]] or [1400], f"{ARMS}: ")
asyncio.run(E.stop())
