"""Paged decode attention: one query token per sequence against its keys and values where they lie in the
paged KV cache, with static shapes and no host synchronisation (CUDA-graph capturable).

    paged_decode_attention(q_BHC, k_cache, v_cache, block_tables_BN, context_lens_B, block_size, scale,
                           *, backend="auto", num_splits=None) -> o_BHC

    B sequences, H query heads, G key/value heads (H % G == 0; query head h reads kv head h // (H // G)),
    C head dim, S cache slots (slot = block * block_size + offset), N blocks per table row (padded with
    any valid block id past the sequence's length).
    q_BHC             [B, H, C]  bf16 / fp16 / fp32 (fp64: the torch reference only)
    k_cache, v_cache  [S, G, C]  in q's dtype
    block_tables_BN   [B, N]     int32 / int64
    context_lens_B    [B]        int: sequence b attends to its tokens 0 .. len - 1, token t at slot
                                 block_tables[b, t // block_size] * block_size + t % block_size;
                                 a length of 0 (a padding row of a static batch) gives zeros
    returns           [B, H, C]  in q's dtype: softmax(scale * q k^T) v, accumulated in float32
                                 (float64 for float64 inputs)

`backend` follows kernels/backend.py: "auto" runs the Triton kernels (kernels/paged_attention_triton.py:
flash-decoding, the KV length split over `num_splits` programs per (sequence, kv head), reading pages in
place) on CUDA, or on CPU under TRITON_INTERPRET=1, else `paged_decode_attention_reference`; float64
always takes the reference under "auto". `num_splits` only affects the Triton path (None: chosen from
the shapes). Lengths above N * block_size are clamped to it (every table entry is then attended).

Both paths depend on the values of `context_lens_B` and `block_tables_BN` only on the device: grid,
splits and every allocation come from shapes, so a decode step can be captured in a CUDA graph and
replayed with new lengths and tables.

Limits: the reference materialises every sequence's N * block_size gathered keys and values in float32
(~4x the cache bytes it reads), so it is for correctness and for CPUs without the C++ kernel
(kernels/cpu_attention.py), not for speed.
"""

from __future__ import annotations

import torch

from kernels.backend import Backend, use_triton

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def paged_decode_attention(q_BHC: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables_BN: torch.Tensor, context_lens_B: torch.Tensor, block_size: int,
                           scale: float, *, backend: Backend = "auto",
                           num_splits: int | None = None) -> torch.Tensor:
    _check(q_BHC, k_cache, v_cache, block_tables_BN, context_lens_B, block_size)
    if q_BHC.dtype == torch.float64:
        if backend == "triton":
            raise ValueError("the Triton paged attention takes bf16, fp16 or fp32, not float64")
        backend = "torch"
    if use_triton(q_BHC.device, backend):
        from kernels.paged_attention_triton import paged_decode_attention_triton
        return paged_decode_attention_triton(q_BHC, k_cache, v_cache, block_tables_BN, context_lens_B,
                                             block_size, scale, num_splits=num_splits)
    return paged_decode_attention_reference(q_BHC, k_cache, v_cache, block_tables_BN, context_lens_B,
                                            block_size, scale)


def paged_decode_attention_reference(q_BHC: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables_BN: torch.Tensor, context_lens_B: torch.Tensor,
                                     block_size: int, scale: float) -> torch.Tensor:
    """Gather every sequence's N pages ([B, N * block_size, G, C]), mask positions >= its length, and
    take an explicit softmax in float32 (float64 for float64). The softmax is written out rather than
    SDPA because an all-masked row (length 0) must give zeros, where SDPA gives NaN."""
    B, H, C = q_BHC.shape
    N = block_tables_BN.shape[1]
    G = k_cache.shape[1]
    L = N * block_size
    acc = torch.float64 if q_BHC.dtype == torch.float64 else torch.float32
    offsets_S = torch.arange(block_size, device=block_tables_BN.device)
    slots = (block_tables_BN.long()[:, :, None] * block_size + offsets_S).reshape(-1)
    k_BGLC = k_cache.index_select(0, slots).view(B, L, G, C).permute(0, 2, 1, 3).to(acc)
    v_BGLC = v_cache.index_select(0, slots).view(B, L, G, C).permute(0, 2, 1, 3).to(acc)
    q_BGQC = q_BHC.view(B, G, H // G, C).to(acc)
    scores_BGQL = torch.matmul(q_BGQC, k_BGLC.transpose(2, 3)) * scale
    keep_BL = torch.arange(L, device=context_lens_B.device)[None, :] < context_lens_B[:, None]
    scores_BGQL = scores_BGQL.masked_fill(~keep_BL[:, None, None, :], float("-inf"))
    m_BGQ1 = scores_BGQL.amax(dim=-1, keepdim=True)
    # A length-0 row has max -inf: shift it by 0 instead, so that exp gives 0 rather than NaN.
    m_BGQ1 = torch.where(torch.isfinite(m_BGQ1), m_BGQ1, torch.zeros_like(m_BGQ1))
    p_BGQL = torch.exp(scores_BGQL - m_BGQ1)
    l_BGQ1 = p_BGQL.sum(dim=-1, keepdim=True)
    o_BGQC = torch.matmul(p_BGQL, v_BGLC) / torch.where(l_BGQ1 > 0, l_BGQ1, torch.ones_like(l_BGQ1))
    return o_BGQC.reshape(B, H, C).to(q_BHC.dtype)


def _check(q_BHC, k_cache, v_cache, block_tables_BN, context_lens_B, block_size) -> None:
    if q_BHC.dim() != 3:
        raise ValueError(f"q_BHC must be [B, H, C], got {tuple(q_BHC.shape)}")
    B, H, C = q_BHC.shape
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.shape[2] != C:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         f"[slots, G, C={C}]")
    G = k_cache.shape[1]
    if G == 0 or H % G:
        raise ValueError(f"H={H} query heads must be a multiple of G={G} kv heads")
    if q_BHC.dtype not in _FLOATS or k_cache.dtype != q_BHC.dtype or v_cache.dtype != q_BHC.dtype:
        raise TypeError(f"q, k_cache and v_cache must share one dtype of {_FLOATS}, got {q_BHC.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if block_tables_BN.dim() != 2 or block_tables_BN.shape[0] != B:
        raise ValueError(f"block_tables_BN must be [B={B}, N], got {tuple(block_tables_BN.shape)}")
    if block_tables_BN.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_tables_BN must be int32 or int64, not {block_tables_BN.dtype}")
    if context_lens_B.shape != (B,) or context_lens_B.dtype.is_floating_point or context_lens_B.is_complex():
        raise ValueError(f"context_lens_B must be an integer [B={B}], got {context_lens_B.dtype} "
                         f"{tuple(context_lens_B.shape)}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, not {block_size!r}")
    devices = {t.device for t in (q_BHC, k_cache, v_cache, block_tables_BN, context_lens_B)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
