"""The decode MoE variants the tuner picks from (kernels/moe_decode_variants.py) against the torch reference:
split-K partials, swap-AB and the broadcast GEMV, at few tokens and at speculative verification's 16-64."""

from __future__ import annotations

import pytest
import torch

from kernels import MXFP8Tensor, moe_reference, moe_reference_dense
from kernels.moe_decode_variants import (
    KernelTiles,
    VariantConfig,
    VariantLaunches,
    expert_bytes,
    moe_decode_variant,
)
from kernels.op_count import OpCounter
from tests.kernels.moe_data import make_layer

CASES = {  # T, E, K, D, inter, skew
    "one-token-top4": (1, 16, 4, 64, 64, False),
    "three-tokens-D96": (3, 8, 2, 96, 32, False),
    "eighteen-tokens-skewed": (18, 8, 1, 64, 32, True),
}


def layer(case, device, seed=0):
    T, E, K, D, inter, skew = CASES[case]
    x, ids, w, w13, w2 = make_layer(T, E, K, D, inter, seed=seed + T, skew=skew)
    q13, q2 = MXFP8Tensor.quantize(w13, backend="torch"), MXFP8Tensor.quantize(w2, backend="torch")
    on = (MXFP8Tensor(q13.data.to(device), q13.scales.to(device)), MXFP8Tensor(q2.data.to(device), q2.scales.to(device)))
    return (x, ids, w, q13, q2), (x.to(device), ids.to(device), w.to(device), *on)


@pytest.mark.parametrize("case, variant, split", [
    ("one-token-top4", "dot", 2), ("one-token-top4", "fma", 2), ("three-tokens-D96", "dot", 3),
    ("three-tokens-D96", "swap", 2), ("eighteen-tokens-skewed", "swap", 2),
])
def test_variants_match_the_reference_float32(case, variant, split, device):
    (x, ids, w, q13, q2), args = layer(case, device)
    ref = moe_reference(x, ids, w, q13, q2)
    cfg = VariantConfig(variant, KernelTiles(16, 32), KernelTiles(32, 32), split)
    with torch.inference_mode(), OpCounter(strict=True):  # no host sync: it runs inside the captured step
        out = moe_decode_variant(*args, cfg)
    tol = 1e-5 if device.type == "cpu" else 3e-2  # a GPU multiplies bf16 operands
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("variant", ["dot", "fma"])
def test_split_k_in_bfloat16_rounds_h_as_the_reference(variant, device):
    """bf16 activations: the down kernel sums gate_up's float32 partials and rounds h to bf16 as it loads them."""
    (x, ids, w, q13, q2), (xd, idsd, wd, d13, d2) = layer("one-token-top4", device, seed=5)
    x = x.bfloat16()
    ref = moe_reference_dense(x, ids, w, q13, q2)
    out = moe_decode_variant(xd.bfloat16(), idsd, wd, d13, d2, VariantConfig(variant, KernelTiles(16, 32),
                                                                              KernelTiles(32, 64), 2))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_unreduced_rows_and_the_bytes_each_kernel_reads(device):
    (x, ids, w, q13, q2), args = layer("three-tokens-D96", device)
    cfg = VariantConfig("dot", KernelTiles(16, 32), KernelTiles(32, 32), 2)
    run = VariantLaunches(*args, cfg)
    assert run.split == 2 and run.h.shape == (2, 3 * 2, 2 * 32) and run.h.dtype == torch.float32
    run.gate_up()
    run.down()
    rows = run.rows()
    assert rows.shape == (3, 2, 96) and rows.dtype == torch.float32
    torch.testing.assert_close(rows.sum(1).cpu(), moe_decode_variant(*args, cfg).float().cpu())
    used = len(set(ids.flatten().tolist()))
    assert run.expert_bytes() == expert_bytes(ids, 96, 32) == (used * 2 * 96 * 33, used * 96 * 33)


def test_bad_configs_and_sizes_are_refused(device):
    with pytest.raises(ValueError, match="variant"):
        VariantConfig("mma", KernelTiles(16, 32), KernelTiles(16, 32))
    with pytest.raises(ValueError, match="powers of two"):
        VariantConfig("dot", KernelTiles(16, 48), KernelTiles(16, 32))
    with pytest.raises(ValueError, match="split_k"):
        VariantConfig("dot", KernelTiles(16, 32), KernelTiles(16, 32), 0)
    _, (x, ids, w, d13, d2) = layer("one-token-top4", device)
    cfg = VariantConfig("dot", KernelTiles(16, 32), KernelTiles(16, 32))
    with pytest.raises(ValueError, match="1..64 tokens"):
        VariantLaunches(x.repeat(65, 1), ids.repeat(65, 1), w.repeat(65, 1), d13, d2, cfg)
