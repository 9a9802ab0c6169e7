"""The CPU expert paths: the cost model's choice, and the grouped path's handling of skew and empty experts."""

from __future__ import annotations

import torch

from kernels.moe import CpuCosts, cpu_path_costs, moe_forward
from kernels.moe_reference import moe_all_experts, moe_grouped_cpu, moe_reference
from tests.kernels.moe_data import make_layer


def choice(T: int, K: int, counts: list[int], D: int = 512, inter: int = 256, costs: CpuCosts | None = None) -> str:
    c = cpu_path_costs(T, K, counts, D, inter, 4, **({"costs": costs} if costs else {}))
    return "all" if c["all"] < c["grouped"] else "grouped"


def test_decode_batches_of_a_32_expert_model_take_the_grouped_path():
    # batch 8, top-4 of 32: ~20 experts hit; running all 32 would read 60% more bytes and do 8x the FLOPs
    assert choice(8, 4, [1] * 20 + [0] * 12 + []) == "grouped"
    # batch 32: every expert hit, yet all-experts would still do 8x the FLOPs
    assert choice(32, 4, [4] * 32) == "grouped"
    assert choice(1, 4, [1] * 4 + [0] * 28) == "grouped"


def test_all_experts_wins_only_where_ops_dominate():
    # every expert is routed anyway (E == K): same bytes and FLOPs, fewer ops
    assert choice(1, 4, [1, 1, 1, 1]) == "all"
    # and with tiny experts, when a small op costs far more than the arithmetic
    assert choice(2, 2, [1] * 4, D=8, inter=4, costs=CpuCosts(op_s=1e-3)) == "all"
    # but not when most experts would be read for nothing
    assert choice(2, 2, [1] * 4 + [0] * 60) == "grouped"


def test_grouped_path_skips_experts_nobody_picked():
    x, ids, w, w13, w2 = make_layer(24, 16, 2, 256, 128, seed=5, skew=True)
    unused = sorted(set(range(16)) - set(ids.flatten().tolist()))
    assert unused  # the skewed router leaves the last experts empty
    w13[unused], w2[unused] = float("nan"), float("nan")  # reading them would poison the output
    with torch.inference_mode():
        got = moe_grouped_cpu(x, ids, w, w13, w2)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, moe_reference(x, ids, w, w13, w2), rtol=1e-5, atol=1e-5)
        assert choice(24, 2, torch.bincount(ids.flatten(), minlength=16).tolist(), 256, 128) == "grouped"
        torch.testing.assert_close(moe_forward(x, ids, w, w13, w2), got, rtol=0, atol=0)  # the seam's pick


def test_grouped_path_in_bfloat16_sums_in_float32():
    x, ids, w, w13, w2 = make_layer(16, 8, 2, 64, 32, seed=6)
    with torch.inference_mode():
        got = moe_grouped_cpu(x.bfloat16(), ids, w, w13.bfloat16(), w2.bfloat16())
        want = moe_all_experts(x.bfloat16(), ids, w, w13.bfloat16(), w2.bfloat16())
    assert got.dtype == torch.bfloat16
    ref = moe_reference(x, ids, w, w13, w2)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 2e-2
    assert ((want.float() - ref).norm() / ref.norm()).item() < 2e-2


def test_mxfp8_experts_held_dequantized_give_the_references_result_bit_for_bit():
    """A CPU server holds small MXFP8 experts dequantized (MXFP8Tensor.with_dense) and runs them through
    the grouped path: the same sums in the same order as the reference it replaces, in float64 and
    float32, so a float64 server's tokens do not move."""
    from kernels import MXFP8Tensor

    torch.manual_seed(0)
    E, D, inter = 8, 128, 64
    w13 = MXFP8Tensor.quantize(torch.randn(E, 2 * inter, D) * 0.1)
    w2 = MXFP8Tensor.quantize(torch.randn(E, D, inter) * 0.1)
    for dtype in (torch.float64, torch.float32):
        d13, d2 = w13.with_dense(dtype), w2.with_dense(dtype)
        for T in (1, 3, 9, 33):
            x = torch.randn(T, D, dtype=dtype)
            ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
            weights = torch.rand(T, 2, dtype=dtype)
            with torch.inference_mode():
                want = moe_reference(x, ids, weights, w13, w2)
                got = moe_forward(x, ids, weights, d13, d2)  # as a CPU server runs it (interpreter on or not)
            assert torch.equal(got, want), (dtype, T)
    with torch.inference_mode():  # a dense copy in another dtype is not used
        assert torch.equal(moe_forward(x, ids, weights, w13.with_dense(torch.float64), w2, backend="torch"),
                           moe_reference(x, ids, weights, w13, w2))
