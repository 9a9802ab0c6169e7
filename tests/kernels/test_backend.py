"""When the Triton kernels run and when the torch references do; `import kernels` without triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.backend as backend

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_uses_triton_only_under_the_interpreter(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(backend, "triton_installed", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.use_triton(cpu) and backend.use_triton(cpu, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not backend.use_triton(cpu)
    assert "TRITON_INTERPRET" in backend.why_not_triton(cpu)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        backend.use_triton(cpu, "triton")
    assert not backend.use_triton(cpu, "torch")
    with pytest.raises(ValueError):
        backend.use_triton(cpu, "cuda")


def test_cuda_uses_triton_when_installed(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(backend, "triton_installed", lambda: True)
    assert backend.use_triton(cuda)
    monkeypatch.setattr(backend, "triton_installed", lambda: False)
    assert not backend.use_triton(cuda)
    assert "not installed" in backend.why_not_triton(cuda)


def _run(code: str, env_extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


SERVE_ON_CPU = (
    "import sys, torch\n"
    "{block}"
    "import kernels\n"
    "x = torch.randn(3, 64)\n"
    "ids = torch.tensor([[0, 1], [1, 2], [3, 0]]); w = torch.full((3, 2), 0.5)\n"
    "w13 = kernels.MXFP8Tensor.quantize(torch.randn(4, 64, 64))\n"
    "w2 = kernels.MXFP8Tensor.quantize(torch.randn(4, 64, 32))\n"
    "y = kernels.moe_forward(x, ids, w, w13, w2)\n"
    "print(tuple(y.shape), sys.modules.get('triton') is not None)\n"
)


def test_import_and_cpu_serving_without_triton():
    block = "sys.modules['triton'] = None  # as if not installed: importing it raises ImportError\n"
    assert _run(SERVE_ON_CPU.format(block=block), {}) == "(3, 64) False"


def test_cpu_serving_does_not_touch_triton_without_the_interpreter():
    assert _run(SERVE_ON_CPU.format(block=""), {}) == "(3, 64) False"
