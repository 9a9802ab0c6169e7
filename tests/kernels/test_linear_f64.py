"""The float64 few-row linear kernel (csrc/linear_f64_cpu.cpp) against F.linear, and where the served model
takes it (numerics.proj, Qwen3MoeModel.logits)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ext
from serve.model import numerics

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernel cannot be built here (the torch path stays)")


@pytest.fixture(scope="module")
def kernels():
    return cpu_ext.build()


@pytest.mark.parametrize(("N", "D"), [(256, 128), (128, 128), (4096, 128), (24, 40), (8, 8)])
def test_matches_f_linear_and_rows_do_not_depend_on_the_others(kernels, N, D):
    g = torch.Generator().manual_seed(N + D)
    w = torch.randn(N, D, generator=g, dtype=torch.float64)
    x = torch.randn(16, D, generator=g, dtype=torch.float64)
    for R in (1, 2, 5, 9, 16):
        got = kernels.linear_f64(x[:R], w)
        want = F.linear(x[:R], w)
        assert got.shape == (R, N) and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-13 * want.abs().max().item(), rtol=1e-12)
    together = kernels.linear_f64(x, w)
    for r in range(16):  # a decode's row and the same row in a verify step: bit for bit
        assert torch.equal(kernels.linear_f64(x[r : r + 1], w)[0], together[r]), r


def test_refuses_what_it_cannot_take(kernels):
    w, x = torch.randn(16, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float64 only"):
        kernels.linear_f64(x.float(), w.float())
    with pytest.raises(RuntimeError, match="multiples of 8"):
        kernels.linear_f64(torch.randn(2, 12, dtype=torch.float64), torch.randn(16, 12, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.linear_f64(x, torch.randn(8, 16, dtype=torch.float64).T)


def test_proj_takes_it_for_few_float64_rows_only(kernels):
    torch.manual_seed(0)
    m = torch.nn.Linear(128, 256, bias=False, dtype=torch.float64)
    assert numerics.linear_f64_takes(m)
    with torch.inference_mode():
        for rows in (1, 9, 16):
            x = torch.randn(rows, 128, dtype=torch.float64)
            assert torch.equal(numerics.proj(m, x, False, kernels), kernels.linear_f64(x, m.weight))
        x = torch.randn(17, 128, dtype=torch.float64)  # a prefill's rows: MKL's GEMM
        assert not numerics.few_rows(x)
        torch.testing.assert_close(numerics.proj(m, x, False, kernels), F.linear(x, m.weight))
    # weights the kernel cannot take (pack_for_cpu gives those layers no kernels)
    assert not numerics.linear_f64_takes(torch.nn.Linear(128, 256, bias=False))  # float32
    assert not numerics.linear_f64_takes(torch.nn.Linear(128, 256, dtype=torch.float64))  # a bias
    assert not numerics.linear_f64_takes(torch.nn.Linear(128, 12, bias=False, dtype=torch.float64))
    x = torch.randn(2, 128, dtype=torch.float64)
    assert not numerics.few_rows(x)  # grad on: training
    assert numerics.proj(m, x, False, kernels).requires_grad  # so the module's own forward, with its graph


def test_the_served_float64_model_takes_it_for_heads_and_projections(kernels):
    """pack_for_cpu in float64 hands the kernels to every attention layer and the LM head; the logits of a
    step's rows then do not depend on how many rows it has."""
    from dataclasses import replace

    from serve.cli import BUILTIN_DIR
    from serve.model.config import ModelConfig
    from serve.model.qwen3_moe import Qwen3MoeModel

    torch.manual_seed(0)
    model = Qwen3MoeModel(replace(ModelConfig.from_dir(BUILTIN_DIR), num_hidden_layers=1)).to(torch.float64).eval()
    model.pack_for_cpu(cpu_kernels=kernels)
    assert model.f64_kernels is kernels and all(layer.self_attn.f64_kernels is kernels for layer in model.layers)
    assert all(moe.gate_kernels is kernels for moe in model.moe_layers())
    with torch.inference_mode():
        h = torch.randn(9, model.cfg.hidden_size, dtype=torch.float64)
        together = model.logits(h)
        for r in range(9):
            assert torch.equal(model.logits(h[r : r + 1])[0], together[r]), r
        head = model.lm_head if model.lm_head is not None else model.embed_tokens
        torch.testing.assert_close(together, F.linear(h, head.weight))
