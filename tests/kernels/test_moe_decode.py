"""The decode MoE kernels (kernels/moe_decode_triton.py) against the torch reference: few tokens, fresh
random inputs, skewed routing (experts nobody picked, one picked by every token), bf16 and float32."""

from __future__ import annotations

import pytest
import torch

from kernels import MXFP8Tensor, moe_forward, moe_reference, moe_reference_dense
from kernels.launches import on_launch
from kernels.moe_decode_triton import DECODE_MAX_TOKENS, fused_moe_mxfp8_decode
from kernels.op_count import OpCounter
from tests.kernels.moe_data import make_layer

CASES = {  # T, E, K, D, inter, skew
    "one-token-top4": (1, 16, 4, 64, 64, False),
    "three-tokens-top2": (3, 8, 2, 96, 32, False),
    "eight-tokens-skewed": (8, 16, 4, 64, 64, True),
    "sixteen-tokens-top8": (16, 32, 8, 64, 96, False),
}


def quantized(w13, w2, device):
    q13, q2 = MXFP8Tensor.quantize(w13, backend="torch"), MXFP8Tensor.quantize(w2, backend="torch")
    return q13, q2, MXFP8Tensor(q13.data.to(device), q13.scales.to(device)), \
        MXFP8Tensor(q2.data.to(device), q2.scales.to(device))


@pytest.mark.parametrize("case", list(CASES))
def test_decode_kernels_match_the_reference_float32(case, device):
    T, E, K, D, inter, skew = CASES[case]
    x, ids, w, w13, w2 = make_layer(T, E, K, D, inter, seed=7 + T, skew=skew)
    q13, q2, d13, d2 = quantized(w13, w2, device)
    ref = moe_reference(x, ids, w, q13, q2)
    out = fused_moe_mxfp8_decode(x.to(device), ids.to(device), w.to(device), d13, d2)
    tol = 1e-5 if device.type == "cpu" else 3e-2  # a GPU multiplies bf16 operands
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("case", ["one-token-top4", "eight-tokens-skewed"])
def test_decode_kernels_match_the_reference_bfloat16(case, device):
    T, E, K, D, inter, skew = CASES[case]
    x, ids, w, w13, w2 = make_layer(T, E, K, D, inter, seed=11, skew=skew)
    q13, q2, d13, d2 = quantized(w13, w2, device)
    x = x.bfloat16()
    ref = moe_reference_dense(x, ids, w, q13, q2)
    out = fused_moe_mxfp8_decode(x.to(device), ids.to(device), w.to(device), d13, d2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_the_seam_takes_the_decode_kernels_for_few_tokens_only(device):
    """moe_forward: two launches and no alignment up to DECODE_MAX_TOKENS, the grouped kernels above; no
    host sync on either path (both run inside the decode step's CUDA graph)."""
    for T, want in ((1, ["moe_decode_gate_up", "moe_decode_down"]),
                    (DECODE_MAX_TOKENS, ["moe_decode_gate_up", "moe_decode_down"]),
                    (DECODE_MAX_TOKENS + 1, ["moe_align", "moe_gate_up", "moe_down"])):
        x, ids, w, w13, w2 = make_layer(T, 16, 2, 64, 32, seed=T)
        q13, q2, d13, d2 = quantized(w13, w2, device)
        launches: list[str] = []
        with torch.inference_mode(), on_launch(launches.append), OpCounter(strict=True):
            out = moe_forward(x.to(device), ids.to(device), w.to(device), d13, d2, backend="triton")
        assert launches == want, (T, launches)
        ref = moe_reference(x, ids, w, q13, q2)
        tol = 1e-5 if device.type == "cpu" else 3e-2
        torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_unreduced_rows_are_the_per_pair_terms_of_the_sum(device):
    """moe_forward(..., reduce=False) on the Triton kernels (decode and grouped sizes): float32 rows
    [T, K, D] whose sum over K is the reduced output, and no extra launch or op for the sum (the decode
    step's add_rms_norm does it); a path without such rows (the torch reference) returns [T, D]."""
    for T in (3, DECODE_MAX_TOKENS + 1):
        x, ids, w, w13, w2 = make_layer(T, 16, 2, 64, 32, seed=T + 1)
        _, _, d13, d2 = quantized(w13, w2, device)
        args = (x.to(device), ids.to(device), w.to(device), d13, d2)
        with torch.inference_mode(), OpCounter() as c:
            rows = moe_forward(*args, backend="triton", reduce=False)
        assert rows.shape == (T, 2, 64) and rows.dtype == torch.float32
        assert "aten.sum" not in c.ops
        out = moe_forward(*args, backend="triton")
        torch.testing.assert_close(rows.sum(1).to(out.dtype), out, rtol=0, atol=0)
        assert moe_forward(*args, backend="torch", reduce=False).shape == (T, 64)


def test_an_expert_every_token_picked_is_read_by_one_slot(device):
    """All T tokens route to expert 0 (and each to one other): the first slot's programs serve every
    token of expert 0, later slots of it return; the result still matches."""
    T, E, K, D, inter = 6, 8, 2, 64, 32
    x, _, w, w13, w2 = make_layer(T, E, K, D, inter, seed=5)
    ids = torch.stack([torch.zeros(T, dtype=torch.long), torch.arange(1, T + 1) % E], 1)
    ids[:, 1][ids[:, 1] == 0] = 7
    q13, q2, d13, d2 = quantized(w13, w2, device)
    out = fused_moe_mxfp8_decode(x.to(device), ids.to(device), w.to(device), d13, d2)
    ref = moe_reference(x, ids, w, q13, q2)
    tol = 1e-5 if device.type == "cpu" else 3e-2
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())
