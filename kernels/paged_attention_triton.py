"""Paged decode attention in Triton (flash-decoding): keys and values are read where they lie in the
paged cache, the KV length split over several programs per sequence, the splits then combined.

Approach:
1. `_split_kernel`, grid (B, G, num_splits): a program takes one sequence, one kv head and all H // G
   query heads that share it (padded to BLOCK_H >= 16 rows for tl.dot), so each K/V byte is read once
   per kv head, not once per query head. Its split is the s-th of num_splits equal runs of the
   sequence's own length (rounded to BLOCK_N, computed on the device: a 300-token context in a table
   sized for 40k tokens still uses every split), walked BLOCK_N tokens at a time: each token's block id comes from the block table (a gather: a tile may span pages, and
   block_size need not be a power of two), then its K/V rows at block * block_size + offset. Online
   softmax in float32 (exp2, scores pre-multiplied by scale * log2(e)). It writes the unnormalised
   partial o and its (m, l) in float32; a split that starts past the length writes (0, -inf, 0).
   With one split it normalises and writes the output itself, and the reduce does not run.
2. `_reduce_kernel`, grid (B, H): o = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s, M = max_s m_s;
   a row with no tokens at all (length 0) gives zeros, not NaN.

Static shapes: the grid, num_splits and the buffers depend on B, H, G, N and block_size only; the lengths
and tables are read on the device (a program's loop bound is its loaded length), so nothing syncs with
the host and a decode step can be captured in a CUDA graph.

Limits: tile sizes and the split heuristic are first guesses, never run or tuned on a GPU (none was at
hand when this was written); the query-head group is padded to 16 rows for tl.dot, which costs nothing
on a bandwidth-bound decode but wastes MMA work for H // G < 16. Under the interpreter everything is
float32 (it has no bf16 math) and the output is written in float32 and cast by torch, because its
float32 -> bf16 store truncates instead of rounding. float64 is not supported (the torch reference is).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.backend import interpreting
from kernels.launches import launch

MAX_SPLITS = 16
TOKENS_PER_SPLIT = 512  # aim: enough work per program to hide its fixed cost, enough programs to fill SMs


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, o_part_ptr, m_part_ptr, l_part_ptr,
                  N, C, num_splits, qk_scale,
                  stride_qb, stride_qh, stride_qc,
                  stride_ks, stride_kg, stride_kc,
                  stride_vs, stride_vg, stride_vc,
                  stride_tb, stride_tn, stride_lb,
                  stride_ob, stride_oh, stride_oc,
                  stride_pb, stride_ph, stride_ps, stride_pc,
                  stride_mb, stride_mh, stride_ms,
                  QH: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_C: tl.constexpr, F32_DOT: tl.constexpr, SINGLE_SPLIT: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    # Lengths past the table are clamped (every page attended); negative ones count as empty.
    seq_len = tl.load(lens_ptr + b.to(tl.int64) * stride_lb).to(tl.int32)
    seq_len = tl.maximum(tl.minimum(seq_len, N * BLOCK_SIZE), 0)
    # The splits share this sequence's own length (read here, not fixed by the table's width), so a short
    # context still spreads over every split's program instead of leaving one program all the work.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = s * per_split
    end = tl.minimum(start + per_split, seq_len)

    h_H = tl.arange(0, BLOCK_H)
    ok_H = h_H < QH
    head_H = g * QH + h_H
    c_C = tl.arange(0, BLOCK_C)
    ok_C = c_C < C
    q_HC = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head_H[:, None] * stride_qh + c_C[None, :] * stride_qc,
                   mask=ok_H[:, None] & ok_C[None, :], other=0.0)
    if F32_DOT:
        q_HC = q_HC.to(tl.float32)
    table_row = tables_ptr + b.to(tl.int64) * stride_tb

    m_H = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_H = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_HC = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t_N = t0 + tl.arange(0, BLOCK_N)
        ok_N = t_N < end
        block_N = tl.load(table_row + (t_N // BLOCK_SIZE) * stride_tn, mask=ok_N, other=0).to(tl.int64)
        slot_N = block_N * BLOCK_SIZE + t_N % BLOCK_SIZE
        kv_mask = ok_N[:, None] & ok_C[None, :]
        k_NC = tl.load(k_ptr + slot_N[:, None] * stride_ks + g * stride_kg + c_C[None, :] * stride_kc,
                       mask=kv_mask, other=0.0)
        v_NC = tl.load(v_ptr + slot_N[:, None] * stride_vs + g * stride_vg + c_C[None, :] * stride_vc,
                       mask=kv_mask, other=0.0)
        if F32_DOT:
            scores_HN = tl.dot(q_HC, tl.trans(k_NC.to(tl.float32)), input_precision="ieee")
        else:
            scores_HN = tl.dot(q_HC, tl.trans(k_NC))
        scores_HN = tl.where(ok_N[None, :], scores_HN * qk_scale, float("-inf"))
        # Each tile holds >= 1 valid token, so m_new is finite and the -inf of the first pass gives alpha 0.
        m_new_H = tl.maximum(m_H, tl.max(scores_HN, axis=1))
        alpha_H = tl.exp2(m_H - m_new_H)
        p_HN = tl.exp2(scores_HN - m_new_H[:, None])
        l_H = l_H * alpha_H + tl.sum(p_HN, axis=1)
        if F32_DOT:
            acc_HC = tl.dot(p_HN, v_NC.to(tl.float32), acc_HC * alpha_H[:, None], input_precision="ieee")
        else:
            acc_HC = tl.dot(p_HN.to(v_NC.dtype), v_NC, acc_HC * alpha_H[:, None])
        m_H = m_new_H

    store_mask = ok_H[:, None] & ok_C[None, :]
    if SINGLE_SPLIT:
        o_HC = acc_HC / tl.where(l_H > 0, l_H, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + head_H[:, None] * stride_oh + c_C[None, :] * stride_oc,
                 o_HC.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = b.to(tl.int64) * stride_pb + s * stride_ps
        tl.store(o_part_ptr + part + head_H[:, None] * stride_ph + c_C[None, :] * stride_pc, acc_HC,
                 mask=store_mask)
        ml = b.to(tl.int64) * stride_mb + head_H * stride_mh + s * stride_ms
        tl.store(m_part_ptr + ml, m_H, mask=ok_H)
        tl.store(l_part_ptr + ml, l_H, mask=ok_H)


@triton.jit
def _reduce_kernel(o_part_ptr, m_part_ptr, l_part_ptr, out_ptr, C, num_splits,
                   stride_pb, stride_ph, stride_ps, stride_pc,
                   stride_mb, stride_mh, stride_ms,
                   stride_ob, stride_oh, stride_oc,
                   BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s_S = tl.arange(0, BLOCK_S)
    ok_S = s_S < num_splits
    c_C = tl.arange(0, BLOCK_C)
    ok_C = c_C < C
    ml = b * stride_mb + h * stride_mh + s_S * stride_ms
    m_S = tl.load(m_part_ptr + ml, mask=ok_S, other=float("-inf"))
    l_S = tl.load(l_part_ptr + ml, mask=ok_S, other=0.0)
    o_SC = tl.load(o_part_ptr + b * stride_pb + h * stride_ph + s_S[:, None] * stride_ps + c_C[None, :] * stride_pc,
                   mask=ok_S[:, None] & ok_C[None, :], other=0.0)
    m_max = tl.max(m_S, axis=0)
    # No split saw a token (length 0): shift by 0 so every weight is 2^-inf = 0, not 2^(-inf + inf) = NaN.
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    w_S = tl.exp2(m_S - m_max)
    l_sum = tl.sum(w_S * l_S, axis=0)
    o_C = tl.sum(w_S[:, None] * o_SC, axis=0) / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + c_C * stride_oc, o_C.to(out_ptr.dtype.element_ty),
             mask=ok_C)


def choose_num_splits(num_pages: int, block_size: int) -> int:
    """Splits for tables of `num_pages` pages: about one per TOKENS_PER_SPLIT tokens, at most MAX_SPLITS
    and at most one per page. Shapes only, never lengths: a captured graph keeps its grid."""
    if num_pages <= 0:
        return 1
    return max(1, min(MAX_SPLITS, num_pages, -(-num_pages * block_size // TOKENS_PER_SPLIT)))


def paged_decode_attention_triton(q_BHC: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables_BN: torch.Tensor, context_lens_B: torch.Tensor,
                                  block_size: int, scale: float, *,
                                  num_splits: int | None = None) -> torch.Tensor:
    """The kernel path of kernels.paged_attention.paged_decode_attention (which checks the arguments)."""
    B, H, C = q_BHC.shape
    N = block_tables_BN.shape[1]
    G = k_cache.shape[1]
    QH = H // G
    if B == 0 or N == 0:  # no programs to launch; with no pages every length is effectively 0
        return q_BHC.new_zeros((B, H, C))
    if num_splits is None:
        num_splits = choose_num_splits(N, block_size)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, not {num_splits}")
    num_splits = min(num_splits, MAX_SPLITS * 4)
    interp = interpreting()
    f32_dot = interp or q_BHC.dtype == torch.float32
    # The interpreter's float32 -> bf16 store truncates; torch's cast rounds.
    out_dtype = torch.float32 if interp else q_BHC.dtype
    out_BHC = torch.empty((B, H, C), dtype=out_dtype, device=q_BHC.device)
    BLOCK_C = max(16, triton.next_power_of_2(C))
    BLOCK_H = max(16, triton.next_power_of_2(QH))
    BLOCK_N = max(16, min(64, triton.next_power_of_2(-(-N * block_size // num_splits))))
    single = num_splits == 1
    if single:  # the kernel writes out_BHC itself; these stand in for the unused partial buffers
        o_part_BHSC = m_part_BHS = l_part_BHS = out_BHC.new_empty((1, 1, 1, 1), dtype=torch.float32)
        p_strides, m_strides = (0, 0, 0, 0), (0, 0, 0)
    else:
        o_part_BHSC = torch.empty((B, H, num_splits, C), dtype=torch.float32, device=q_BHC.device)
        m_part_BHS = torch.empty((B, H, num_splits), dtype=torch.float32, device=q_BHC.device)
        l_part_BHS = torch.empty_like(m_part_BHS)
        p_strides, m_strides = o_part_BHSC.stride(), m_part_BHS.stride()

    with launch("paged_attention_split"):
        _split_kernel[(B, G, num_splits)](
            q_BHC, k_cache, v_cache, block_tables_BN, context_lens_B, out_BHC, o_part_BHSC, m_part_BHS,
            l_part_BHS, N, C, num_splits, scale * math.log2(math.e),
            *q_BHC.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables_BN.stride(),
            context_lens_B.stride(0), *out_BHC.stride(), *p_strides, *m_strides,
            QH=QH, BLOCK_SIZE=block_size, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C,
            F32_DOT=f32_dot, SINGLE_SPLIT=single, num_warps=4, num_stages=2)
    if not single:
        with launch("paged_attention_reduce"):
            _reduce_kernel[(B, H)](
                o_part_BHSC, m_part_BHS, l_part_BHS, out_BHC, C, num_splits,
                *p_strides, *m_strides, *out_BHC.stride(),
                BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_C=BLOCK_C, num_warps=4)
    return out_BHC if out_dtype == q_BHC.dtype else out_BHC.to(q_BHC.dtype)
