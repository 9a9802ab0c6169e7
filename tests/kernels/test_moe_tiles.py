"""The grouped MoE kernels' autotuned launch (kernels/moe_triton.py): the wiring runs under the
interpreter with one candidate per kernel (the autotuner times nothing then), and gives the fixed
tiles' result; the rule for when a GPU autotunes."""

from __future__ import annotations

import pytest
import torch
import triton

import kernels.moe_triton as mt
from kernels import MXFP8Tensor, moe_reference
from tests.kernels.moe_data import make_layer


@pytest.mark.parametrize("shape", [(32, 64, 4, 1), (64, 32, 4, 1)])
def test_the_autotuned_launch_computes_the_fixed_tiles_result(monkeypatch, shape, device):
    one = mt._configs([shape])
    monkeypatch.setattr(mt, "_gate_up_tuned", triton.autotune(one, key=["token_bucket", "D", "INTER"])(mt._gate_up_kernel))
    monkeypatch.setattr(mt, "_down_tuned", triton.autotune(one, key=["token_bucket", "D", "INTER"])(mt._down_kernel))
    x, ids, w, w13, w2 = make_layer(40, 8, 2, 64, 64, seed=3)  # past the decode kernels' 16 tokens
    q13, q2 = MXFP8Tensor.quantize(w13, backend="torch"), MXFP8Tensor.quantize(w2, backend="torch")
    d13, d2 = (MXFP8Tensor(q.data.to(device), q.scales.to(device)) for q in (q13, q2))
    args = (x.to(device), ids.to(device), w.to(device), d13, d2)
    tuned = mt.fused_moe_mxfp8(*args, autotune=True)
    fixed = mt.fused_moe_mxfp8(*args, autotune=False)
    ref = moe_reference(x, ids, w, q13, q2)
    tol = 1e-5 if device.type == "cpu" else 3e-2
    torch.testing.assert_close(tuned.cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    torch.testing.assert_close(tuned, fixed, rtol=tol, atol=tol * ref.abs().max().item())


def test_when_a_gpu_autotunes(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(mt, "interpreting", lambda: False)
    assert mt.autotuning(cuda, explicit_tiles=False)
    assert not mt.autotuning(cuda, explicit_tiles=True) and not mt.autotuning(cpu, explicit_tiles=False)
    monkeypatch.setenv("COMPOSER_MOE_AUTOTUNE", "0")
    assert not mt.autotuning(cuda, explicit_tiles=False)
    assert [mt.token_bucket(t) for t in (17, 33, 600, 10**5)] == [32, 64, 1024, 8192]
