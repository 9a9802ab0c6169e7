"""kernels/fp8_block.py: the block-FP8 format against transformers' own FineGrainedFP8 quantizer, and its checks."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_block import (
    check_pair,
    dequantize_block_fp8,
    fp8_linear_reference,
    mxfp8_reencode_error,
    quantize_block_fp8,
    scale_shape,
)


def _transformers_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize op (the one FineGrainedFP8Config runs), outside a model load."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class _Quantizer:  # what the op reads of its HfQuantizer
        quantization_config = FineGrainedFP8Config(weight_block_size=(128, 128))

    out = Fp8Quantize(_Quantizer()).convert({"m.weight": w})
    return out["m.weight"], out["m.weight_scale_inv"]


def test_quantizer_matches_transformers_bit_for_bit():
    torch.manual_seed(0)
    w = torch.randn(256, 384, dtype=torch.bfloat16) * torch.logspace(-3, 1, 384, dtype=torch.bfloat16)
    w[:128, :128] = 0  # an all-zero block keeps scale 1 in both
    data, scale_inv = quantize_block_fp8(w)
    ref_data, ref_scale = _transformers_quantize(w)
    assert scale_inv.shape == (2, 3) and scale_inv.dtype == torch.float32
    assert torch.equal(scale_inv, ref_scale) and scale_inv[0, 0] == 1
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))


def test_round_trip_error_and_partial_blocks():
    torch.manual_seed(1)
    w = torch.randn(200, 136)  # partial blocks on both dims: scales [2, 2]
    data, scale_inv = quantize_block_fp8(w)
    assert scale_shape(w.shape) == (2, 2) == tuple(scale_inv.shape)
    back = dequantize_block_fp8(data, scale_inv, torch.float32)
    # e4m3 keeps 3 mantissa bits: a normal value is within 2^-4 relative; tiny ones within the block's step
    err = (back - w).abs()
    step = scale_inv.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :136] * 2.0**-9
    assert bool((err <= w.abs() * 2.0**-4 + step).all())
    # each block's largest element maps onto 448 exactly
    assert data.float().abs().amax() == 448


def test_reference_linear_is_the_dequantized_matmul():
    torch.manual_seed(2)
    w, x, b = torch.randn(130, 260), torch.randn(3, 260), torch.randn(130)
    data, s = quantize_block_fp8(w)
    got = fp8_linear_reference(x, data, s, b)
    want = x @ dequantize_block_fp8(data, s, torch.float32).T + b
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_pairs_are_refused_by_name():
    data, s = quantize_block_fp8(torch.randn(256, 256))
    with pytest.raises(ValueError, match=r"q_proj.weight_scale_inv: expected .*\[2, 2\].*got .*\[2, 1\]"):
        check_pair(data, s[:, :1], name="q_proj.weight")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        check_pair(data.float(), s)
    with pytest.raises(ValueError, match="2-D float"):
        quantize_block_fp8(torch.randn(2, 3, 4))


def test_mxfp8_reencoding_error_is_small_but_not_zero():
    torch.manual_seed(3)
    data, s = quantize_block_fp8(torch.randn(128, 256))
    err = mxfp8_reencode_error(dequantize_block_fp8(data, s, torch.float32))
    assert 0 < err < 0.05
