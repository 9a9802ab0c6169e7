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


# ---------------------------------------------------------------- gate_up and down in one launch

FUSED = (KernelTiles(32, 32), KernelTiles(32, 32))  # a 32-wide slice of I, 32-wide D tiles


@pytest.mark.parametrize("case, variant", [("one-token-top4", "dot"), ("three-tokens-D96", "swap"),
                                           ("three-tokens-D96", "fma"), ("eighteen-tokens-skewed", "dot")])
def test_the_fused_kernel_matches_the_reference_in_two_launches_without_a_sync(case, variant, device):
    """gate_up, SwiGLU and down in one kernel, its per-slice partials added in a fixed order by a second."""
    from kernels.launches import on_launch

    (x, ids, w, q13, q2), args = layer(case, device)
    ref = moe_reference(x, ids, w, q13, q2)
    cfg = VariantConfig(variant, *FUSED, fused=True)
    got: list[str] = []
    with torch.inference_mode(), on_launch(got.append), OpCounter(strict=True):
        run = VariantLaunches(*args, cfg)
        run.gate_up()
        run.down()
    assert got == ["moe_decode_fused", "moe_decode_sum"]
    assert run.h.shape == (triton_cdiv(CASES[case][4], 32), CASES[case][0] * CASES[case][2], CASES[case][3])
    out = run.rows().sum(1)
    tol = 1e-5 if device.type == "cpu" else 3e-2
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    again = moe_decode_variant(*args, cfg, reduce=False)  # the same bits: a fixed order, no atomics
    assert torch.equal(again, run.rows())


def test_the_fused_kernel_rounds_h_to_bfloat16_as_the_reference(device):
    (x, ids, w, q13, q2), (xd, idsd, wd, d13, d2) = layer("one-token-top4", device, seed=5)
    ref = moe_reference_dense(x.bfloat16(), ids, w, q13, q2)
    out = moe_decode_variant(xd.bfloat16(), idsd, wd, d13, d2, VariantConfig("dot", *FUSED, fused=True))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_fused_configs_round_trip_and_bad_ones_are_refused():
    cfg = VariantConfig("swap", KernelTiles(64, 128), KernelTiles(128, 256, 4, 1), fused=True)
    assert cfg.to_json()["fused"] is True and VariantConfig.from_json(cfg.to_json()) == cfg
    assert "fused" not in VariantConfig("dot", *FUSED).to_json()  # the tables written before stay as they were
    with pytest.raises(ValueError, match="no split_k"):
        VariantConfig("dot", *FUSED, split_k=2, fused=True)
    with pytest.raises(ValueError, match=">= 32"):
        VariantConfig("dot", KernelTiles(16, 32), KernelTiles(32, 32), fused=True)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.slow
def test_the_fused_kernel_at_the_30b_layer_shape_one_token(device):
    """Qwen3-30B-A3B's layer (D 2048, I 768, top-8; 8 experts in all: the other 120 are never read) for one
    token: the fused kernel against the reference, at tiles the interpreter runs in seconds (3 slices of 256
    over I, all of D in one tile; at the GPU candidates' 64-wide slices and 256-wide K tiles it takes ~80 s,
    and agreed as closely: BENCHMARKS, issue 51)."""
    T, E, K, D, inter = 1, 8, 8, 2048, 768
    x, ids, w, w13, w2 = make_layer(T, E, K, D, inter, seed=30)
    q13, q2 = MXFP8Tensor.quantize(w13, backend="torch"), MXFP8Tensor.quantize(w2, backend="torch")
    ref = moe_reference(x, ids, w, q13, q2)
    on = (MXFP8Tensor(q13.data.to(device), q13.scales.to(device)), MXFP8Tensor(q2.data.to(device), q2.scales.to(device)))
    cfg = VariantConfig("dot", KernelTiles(256, 2048), KernelTiles(512, 512), fused=True)
    out = moe_decode_variant(x.to(device), ids.to(device), w.to(device), *on, cfg)
    gap = float((out.cpu() - ref).abs().max() / ref.abs().max())
    assert gap < (1e-5 if device.type == "cpu" else 3e-2), gap
