"""The float64 expert kernel's two changes of 2026-11-29 (kernels/csrc/moe_f64_cpu.cpp), each as a step A/B
of the built-in model (float64, one thread) at 1-9 query rows after CONTEXT tokens, arms alternating step by
step in one process (bench/step_ab.py; log-probs agree to 1e-9):
  narrow          A: the experts' float64 values, B: their exact bfloat16 copies (MXFP8Tensor.narrow)
  build DIR       A: the expert kernel of an earlier build (DIR: its folder under ~/.cache/composer/kernels,
                  e.g. the one before eight weight rows' dots at a time), B: this build's; float64 weights
  build-narrow DIR  the same with the bfloat16 copies the engine serves (e.g. DIR before an expert's weight
                  rows were widened once for all its tokens)
Usage: python bench/serve-results/experts_ab.py narrow|build|build-narrow [DIR] N_STEPS [CONTEXT ...]. Issue 50."""

# ruff: noqa: E402 (the repository root goes on sys.path first)
import asyncio
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import torch

torch.set_num_threads(1)
from bench.step_ab import earlier_build, step_ab
from kernels import cpu_ext
from serve.cli import BUILTIN_DIR
from serve.engine.native import EngineConfig, NativeEngine

mode, args = sys.argv[1], sys.argv[2:]
new = cpu_ext.build()
old = new
if mode.startswith("build"):
    old = earlier_build(args.pop(0))
E = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8))
layers = E.model.moe_layers()
narrow = [(m.w13, m.w2) for m in layers]
wide = [(dataclasses.replace(m.w13, narrow=None), dataclasses.replace(m.w2, narrow=None)) for m in layers]


def use(arm: str) -> None:
    for i, m in enumerate(layers):
        m.cpu_kernels = old if arm == "A" else new
        m.w13, m.w2 = narrow[i] if (arm == "B" and mode == "narrow") or mode == "build-narrow" else wide[i]


step_ab(E, use, int(args[0]), [int(x) for x in args[1:]] or [1400], f"experts, {mode}: ")
asyncio.run(E.stop())
