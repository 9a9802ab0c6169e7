"""kernels/batch_invariant_triton.py: each kernel's row alone equals the same row inside batches of several
sizes, bit for bit, and the values match the torch references (kernels/batch_invariant.py) to float32
rounding. On a CPU through the Triton interpreter (tests/kernels/conftest.py); shapes stay tiny."""

from __future__ import annotations

import pytest
import torch

from kernels import batch_invariant as ref
from kernels import batch_invariant_triton as bi
from kernels.mxfp8 import MXFP8Tensor

DTYPES = [torch.bfloat16, torch.float32]
SIZES = (1, 3, 17, 40)  # batches around the row: alone, inside one tile, across tiles


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def batches(x: torch.Tensor, row: int):
    """(batch, where the row sits in it): the row alone, then at varying offsets of bigger batches."""
    for n in SIZES:
        start = max(0, min(row - n // 2, x.shape[0] - n))
        yield x[start:start + n], row - start


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_row_is_the_same_in_any_batch(device, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=g).to(device, dtype)  # K = 96: not a multiple of the K tile
    w = torch.randn(72, 96, generator=g).to(device, dtype) / 8
    b = torch.randn(72, generator=g).to(device, dtype)
    full = bi.matmul(x, w, b)
    close(full, ref.matmul(x, w, b), dtype)
    for row in (0, 21, 39):
        for batch, at in batches(x, row):
            assert torch.equal(bi.matmul(batch, w, b)[at], full[row]), (row, batch.shape)
    assert bi.matmul(x[:0], w).shape == (0, 72)
    with pytest.raises(ValueError, match="want w"):
        bi.matmul(x, w.T)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_log_softmax_silu_rows(device, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 48, generator=g).to(device, dtype)
    u = torch.randn(40, 48, generator=g).to(device, dtype)
    w = (1 + torch.randn(48, generator=g) / 4).to(device, dtype)
    logits = (4 * torch.randn(40, 300, generator=g)).to(device, dtype)  # 300: not a power of two
    norm, lsm, swiglu = bi.rms_norm(x, w, 1e-6), bi.log_softmax(logits), bi.silu_mul(x, u)
    close(norm, ref.rms_norm(x, w, 1e-6), dtype)
    close(lsm, ref.log_softmax(logits), dtype)
    close(swiglu, ref.silu_mul(x, u), dtype)
    assert lsm.dtype == torch.float32 and norm.dtype == dtype
    for row in (0, 17, 39):
        for (xb, at), (lb, _), (ub, _) in zip(batches(x, row), batches(logits, row), batches(u, row), strict=True):
            assert torch.equal(bi.rms_norm(xb, w, 1e-6)[at], norm[row])
            assert torch.equal(bi.log_softmax(lb)[at], lsm[row])
            assert torch.equal(bi.silu_mul(xb, ub)[at], swiglu[row])


def expert_weights(g, dtype, device, E=4, D=64, inter=32):
    w13 = (torch.randn(E, 2 * inter, D, generator=g) / 8).to(device, dtype)
    w2 = (torch.randn(E, D, inter, generator=g) / 8).to(device, dtype)
    return w13, w2


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_token_is_the_same_with_any_other_tokens(device, dtype):
    g = torch.Generator().manual_seed(2)
    T, K = 20, 2
    w13, w2 = expert_weights(g, dtype, device)
    x = torch.randn(T, 64, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(T)]).to(device)
    weights = torch.softmax(torch.randn(T, K, generator=g), -1).to(device, dtype)
    full = bi.moe(x, ids, weights, w13, w2)
    close(full, ref.moe(x, ids, weights, w13, w2), dtype)
    for row in (0, 11, 19):
        for n in (1, 3, 9):  # other tokens pick other experts: the tiles the row sits in change
            s = max(0, min(row - n // 2, T - n))
            assert torch.equal(bi.moe(x[s:s + n], ids[s:s + n], weights[s:s + n], w13, w2)[row - s], full[row])


def test_moe_mxfp8_in_the_kernel_equals_its_dequantized_values(device):
    """Registers-dequantized MXFP8 (the GPU's route) multiplies the numbers the trainer's fake-quantized
    masters hold, so the two give the same bits."""
    g = torch.Generator().manual_seed(3)
    w13, w2 = expert_weights(g, torch.float32, device)
    q13, q2 = MXFP8Tensor.quantize(w13), MXFP8Tensor.quantize(w2)
    x = torch.randn(6, 64, generator=g).to(device, torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1], [2, 0]], device=device)
    weights = torch.full((6, 2), 0.5, device=device, dtype=torch.bfloat16)
    in_kernel = bi.moe(x, ids, weights, q13, q2, mx_in_kernel=True)
    plain = bi.moe(x, ids, weights, q13.dequantize(torch.float32), q2.dequantize(torch.float32))
    assert torch.equal(in_kernel, plain)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_prefill_and_whole_sequence_agree(device, dtype):
    """One query's output is the same bits whether it is scored with its whole sequence (the trainer),
    as one query of a prefill chunk, or decoded alone from the paged cache among other sequences."""
    g = torch.Generator().manual_seed(4)
    B, L, H, G, C, page = 3, 70, 4, 2, 16, 8  # 70 keys: two KV splits (64 + 6), three 32-key blocks
    q = torch.randn(B, L, H, C, generator=g).to(device, dtype)
    k = torch.randn(B, G, L, C, generator=g).to(device, dtype)
    v = torch.randn(B, G, L, C, generator=g).to(device, dtype)
    causal = torch.arange(1, L + 1, device=device).repeat(B, 1)
    whole = bi.attention(q, k, v, causal)
    close(whole, ref.attention(q, k, v, causal), dtype)
    # a prefill chunk: queries 40..55 of sequence 1 after 40 cached keys
    chunk = bi.attention(q[1:2, 40:56], k[1:2], v[1:2], causal[1:2, 40:56])
    assert torch.equal(chunk[0], whole[1, 40:56])
    # decode (splits in parallel, then merged): the last query of each sequence, keys in a shuffled paged cache
    blocks = torch.randperm(32, generator=g)[:B * (L // page + 1)].view(B, -1).to(device, torch.int32)
    j = torch.arange(L, device=device)
    slots = blocks.long()[:, j // page] * page + j % page
    kc = torch.zeros(32 * page, G, C, device=device, dtype=dtype).fill_(float("nan"))  # unwritten slots: NaN
    vc = kc.clone()
    kc[slots], vc[slots] = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    for n in (L, 33, 1):  # contexts of 70, 33 and 1 keys
        dec = bi.attention(q[:, n - 1:n], kc, vc, torch.full((B, 1), n, device=device), blocks, page)
        assert torch.equal(dec[:, 0], whole[:, n - 1]), n
        assert torch.equal(bi.attention(q[2:, n - 1:n], kc, vc, torch.full((1, 1), n, device=device),
                                        blocks[2:], page)[0, 0], whole[2, n - 1])  # alone
