"""The float64 linear kernel (kernels/csrc/linear_f64_cpu.cpp: the built-in model's projections, router and
LM head at 1-16 rows) against torch's paths (numerics.by_weight's GEMM; F.linear for one row of a
projection): first
each weight shape alone (the projection [256, 128], the output projection [128, 128], the LM head
[4,096, 128]; 6 MiB read between calls, as a step's other data evicts L2), then one step of the built-in
model (float64, one thread) at 1-9 query rows after CONTEXT tokens, the arms alternating step by step in
one process (bench/step_ab.py; log-probs agree to 1e-9). Issue 50 (BENCHMARKS, speculative decoding).
Usage: python bench/serve-results/linear_f64_ab.py N_STEPS [CONTEXT ...]."""

# ruff: noqa: E402 (the repository root goes on sys.path first)
import asyncio
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
from bench.step_ab import step_ab
from kernels import cpu_ext
from serve.cli import BUILTIN_DIR
from serve.engine.native import EngineConfig, NativeEngine
from serve.model import numerics

module = cpu_ext.build()
evict = torch.ones(6 * 2**20 // 8, dtype=torch.float64)
for N, D in ((256, 128), (128, 128), (4096, 128)):
    w = torch.randn(N, D, dtype=torch.float64)
    for R in (1, 2, 5, 9):
        x = torch.randn(R, D, dtype=torch.float64)
        # as the model ran them: one row of a projection through F.linear, else by_weight (the head always)
        arms = {"torch": (lambda x=x, w=w: F.linear(x, w)) if R == 1 and N != 4096 else
                (lambda x=x, w=w: numerics.by_weight(w, x).contiguous()),
                "kernel": lambda x=x, w=w: module.linear_f64(x, w)}
        times: dict[str, list[float]] = {k: [] for k in arms}
        for _ in range(100):
            for k, f in arms.items():
                evict.sum()
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        a, b = (statistics.median(times[k]) * 1e6 for k in arms)
        print(f"[{N}, {D}] x {R} rows: torch {a:.1f} us, kernel {b:.1f} us: {b / a:.3f}x", flush=True)

E = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8))
model = E.model
given = (model.f64_kernels, [layer.self_attn.f64_kernels for layer in model.layers],
         [moe.gate_kernels for moe in model.moe_layers()])  # what pack_for_cpu gave the head, attention, routers


def use(m: str) -> None:
    """Arm B: the kernel where the model takes it; arm A: torch's paths (no layer is given the kernels)."""
    head, attn, gates = given if m == "B" else (None, [None] * len(given[1]), [None] * len(given[2]))
    model.f64_kernels = head
    for layer, k in zip(model.layers, attn, strict=True):
        layer.self_attn.f64_kernels = k
    for moe, k in zip(model.moe_layers(), gates, strict=True):
        moe.gate_kernels = k


step_ab(E, use, int(sys.argv[1]), [int(x) for x in sys.argv[2:]] or [1400], "linear: ")
asyncio.run(E.stop())
