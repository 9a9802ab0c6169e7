"""Batch-invariant kernels in Triton: each output row's bits depend on that row's inputs only.

Why: cuBLAS, SDPA and torch's reductions pick tiles, split-K and reduction trees from the shapes they are
handed, so one token's row alone and inside a batch of 32 can differ in the last float32 bit, and the
server's decode, its chunked prefill and the trainer's whole-sequence forward disagree (serve/model/
numerics.py). These kernels fix every reduction's order whatever the batch (Thinking Machines'
batch_invariant_ops, vLLM's and SGLang's batch-invariant modes do the same):
- `matmul`: x [M, K] @ w [N, K].T, fixed BLOCK_M/N/K tiles chosen per device and weight, never per M;
  no split-K: one program walks all of K in one order, float32 accumulation, one rounding at the end.
  M and the strides are not specialised (`do_not_specialize`), so M = 1 compiles to the same code.
- `moe`: the experts as two grouped launches of that same matmul over expert-sorted tiles
  (kernels/moe_align.py: static shapes, no host sync), silu(gate) * up per row, and the router-weighted
  sum of the k experts in slot order (`weighted_sum`), float32. MXFP8 experts are dequantized in registers
  (kernels/mxfp8_triton.py `mx_dot`): the values a bf16 master fake-quantized to MXFP8 holds, so the
  trainer's plain-weight forward and the server's MXFP8 one multiply the same numbers.
- `rms_norm`, `log_softmax`, `silu_mul`: one program per row (or row slice), the row in fixed blocks.
- `attention`: keys 0..n-1 cut into fixed KV splits of ATTN_SPLIT keys from key 0, each walked in blocks
  of ATTN_BLOCK_N with an online softmax in float32 (the kv head's q heads are the rows of two dots), the
  splits' partials merged in split order. Decode (one query a sequence) computes the splits in parallel
  and merges them in a second launch; prefill and the trainer's whole sequences walk them in turn in one
  program; both run the same split code (`_attn_split`) and the same merge, so the bits agree. A token's
  keys are cut into the same splits and blocks whether it is decoded (n = its context), prefilled in any
  chunk, or scored in the trainer's whole sequence (keys after it are masked: lanes of exactly 0 weight).
  K/V come either as dense [B, G, L, C] or as the paged cache [slots, G, C] with block tables
  (`tables_BN`), the same arithmetic either way.
Every grid is a function of shapes, nothing reads a device value on the host: the kernels can be
captured in CUDA graphs. Floating-point contraction is off (`enable_fp_fusion=False`): each multiply and
add rounds on its own, so two compiled variants of a kernel (paged or dense keys, tile rows gathered or
not) do the same arithmetic whatever the compiler would have fused.

Under the Triton interpreter (no bfloat16 arithmetic, a truncating float32 -> bfloat16 cast) bfloat16
tensors are handed over as int16 bits and converted with kernels/mxfp8_triton.py's nearest-even helpers,
and dots run in float32 (exact for products of bfloat16 values; on a GPU bf16 MMA with float32 accumulate).

Limits: tiles are fixed guesses, not tuned (the point is that they do not move); attention's programs
hold 16 (query, head) rows, so a long prefill re-reads its keys for every 16 rows, and decode's parallel
splits stop at MAX_PARALLEL_SPLITS (longer caches walk them in turn); MXFP8 experts with a float16
model are dequantized per call (mx_dot multiplies in bfloat16); rows of -inf only give NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import interpreting
from kernels.launches import launch
from kernels.moe_align import moe_align_block_size
from kernels.mxfp8 import MXFP8Tensor
from kernels.mxfp8_triton import mx_dot

ATTN_BLOCK_N = 32  # keys per attention block, on every device
ATTN_SPLIT = 64  # keys per KV split, on every device: decode runs a sequence's splits in parallel
MAX_PARALLEL_SPLITS = 256  # caches of more than 16k keys a sequence: decode walks the splits in turn too
_DOT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def tiles(n: int = 1 << 30) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of a matmul with n output columns on this kind of device: a function of
    the weight's shape, never of the rows (the server and the trainer multiply the same weights, so they
    pick the same tiles). The interpreter pays per program, so it gets few large ones. A GPU gets 64-row,
    64-deep tiles and narrower columns for narrow weights, so that a decode step's few rows still spread
    a weight over enough programs to stream it at bandwidth (no split-K: that would cut K)."""
    if interpreting():
        return 16, 128, 128
    return 64, 64 if n >= 8192 else 32 if n >= 2048 else 16, 64


# The kernels below convert bfloat16 bits inline instead of calling small @triton.jit helpers: the
# interpreter re-patches triton.language on every helper call (~5 ms each), which made a tiny model's
# attention take seconds per layer.

# ---------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["M", "stride_am", "stride_om"])
def _mm_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, pairs_ptr, tile_expert_ptr, num_padded_ptr,
               M, N, K, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
               A_DIV: tl.constexpr, GROUPED: tl.constexpr, MX: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_BITS: tl.constexpr,
               W_BITS: tl.constexpr, OUT_BITS: tl.constexpr, F32_DOT: tl.constexpr, DOT: tl.constexpr):
    # GROUPED: rows are the expert-sorted (token, slot) pairs of kernels/moe_align.py, M pairs in all;
    # a tile's rows share one expert; A row = pair // A_DIV (the token for gate/up, the pair for down).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return  # past the last real tile: the grid is sized for the worst case (no host sync)
        expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
        pair_M = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        ok_M = pair_M < M
        a_row = (pair_M // A_DIV).to(tl.int64)
        out_row = pair_M.to(tl.int64)
    else:
        expert = 0
        a_row = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        ok_M = a_row < M
        out_row = a_row
    n_N = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok_N = n_N < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the one order of K, whatever M is
        k_K = k0 + tl.arange(0, BLOCK_K)
        ok_K = k_K < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + k_K[None, :], mask=ok_M[:, None] & ok_K[None, :], other=0)
        a = (a.to(tl.int32) << 16).to(tl.float32, bitcast=True) if A_BITS else a.to(tl.float32)
        if MX:
            acc = mx_dot(acc, a, w_base, s_ptr + expert * stride_se, n_N, ok_N, k0, K, stride_wn, stride_sn,
                         BLOCK_M, BLOCK_N, BLOCK_K, False, F32_DOT, False)
        else:
            w = tl.load(w_base + n_N[:, None] * stride_wn + k_K[None, :], mask=ok_N[:, None] & ok_K[None, :], other=0)
            w = (w.to(tl.int32) << 16).to(tl.float32, bitcast=True) if W_BITS else w.to(tl.float32)
            if F32_DOT:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a.to(DOT), tl.trans(w.to(DOT)), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n_N, mask=ok_N, other=0).to(tl.float32)[None, :]
    if OUT_BITS:  # float32 -> bfloat16 bits, nearest-even (the interpreter's own cast truncates)
        b = acc.to(tl.int32, bitcast=True)
        tl.store(out_ptr + out_row[:, None] * stride_om + n_N[None, :],
                 tl.where(acc != acc, 0x7FC0, (b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16),
                 mask=ok_M[:, None] & ok_N[None, :])
    else:
        tl.store(out_ptr + out_row[:, None] * stride_om + n_N[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=ok_M[:, None] & ok_N[None, :])


@triton.jit(do_not_specialize=["R", "stride_xr", "stride_or"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, R, D, eps, stride_xr, stride_or, BLOCK_R: tl.constexpr,
                     BLOCK_D: tl.constexpr, X_BITS: tl.constexpr, W_BITS: tl.constexpr, OUT_BITS: tl.constexpr):
    r_R = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d_D = tl.arange(0, BLOCK_D)
    ok = (r_R < R)[:, None] & (d_D < D)[None, :]
    x = tl.load(x_ptr + r_R[:, None] * stride_xr + d_D[None, :], mask=ok, other=0)
    x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True) if X_BITS else x.to(tl.float32)
    w_D = tl.load(w_ptr + d_D, mask=d_D < D, other=0)
    w_D = (w_D.to(tl.int32) << 16).to(tl.float32, bitcast=True) if W_BITS else w_D.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)  # each row's own sum; padding lanes add 0
    n = x * inv_rms[:, None]
    # the normed x rounded to x's dtype, then times the weight, rounded to the output's
    if X_BITS:
        b = n.to(tl.int32, bitcast=True)
        n = (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        n = n.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = w_D[None, :] * n
    if OUT_BITS:
        b = y.to(tl.int32, bitcast=True)
        y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)
    tl.store(out_ptr + r_R[:, None] * stride_or + d_D[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["R", "stride_xr", "stride_or"])
def _log_softmax_kernel(x_ptr, out_ptr, R, V, stride_xr, stride_or, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                        X_BITS: tl.constexpr):
    r_R = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok_R = r_R < R
    lane = tl.arange(0, BLOCK_V)
    rows = x_ptr + r_R[:, None] * stride_xr
    m = tl.full((BLOCK_R, BLOCK_V), float("-inf"), tl.float32)  # per-lane maxima, then one max per row
    for v0 in range(0, V, BLOCK_V):
        ok = ok_R[:, None] & (v0 + lane < V)[None, :]
        x = tl.load(rows + v0 + lane[None, :], mask=ok, other=0)
        x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True) if X_BITS else x.to(tl.float32)
        m = tl.maximum(m, tl.where(ok, x, float("-inf")))
    m_R = tl.max(m, 1)
    s = tl.zeros((BLOCK_R, BLOCK_V), tl.float32)  # per-lane sums in block order, then one fixed tree per row
    for v0 in range(0, V, BLOCK_V):
        ok = ok_R[:, None] & (v0 + lane < V)[None, :]
        x = tl.load(rows + v0 + lane[None, :], mask=ok, other=0)
        x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True) if X_BITS else x.to(tl.float32)
        s += tl.where(ok, tl.exp(x - m_R[:, None]), 0.0)
    lse_R = m_R + tl.log(tl.where(ok_R, tl.sum(s, 1), 1.0))  # rows past R: no log(0) warning
    for v0 in range(0, V, BLOCK_V):
        ok = ok_R[:, None] & (v0 + lane < V)[None, :]
        x = tl.load(rows + v0 + lane[None, :], mask=ok, other=0)
        x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True) if X_BITS else x.to(tl.float32)
        tl.store(out_ptr + r_R[:, None] * stride_or + v0 + lane[None, :], x - lse_R[:, None], mask=ok)


@triton.jit(do_not_specialize=["R", "stride_gr", "stride_ur", "stride_or"])
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, R, N, stride_gr, stride_ur, stride_or,
                     BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, BITS: tl.constexpr):
    r_R = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i_I = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (r_R < R)[:, None] & (i_I < N)[None, :]
    g = tl.load(g_ptr + r_R[:, None] * stride_gr + i_I[None, :], mask=ok, other=0)
    u = tl.load(u_ptr + r_R[:, None] * stride_ur + i_I[None, :], mask=ok, other=0)
    if BITS:
        g = (g.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        u = (u.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        s = g / (1.0 + tl.exp(-g))
        b = s.to(tl.int32, bitcast=True)  # silu rounded to the dtype, as F.silu leaves it, then times up
        s = (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
        b = (s * u).to(tl.int32, bitcast=True)
        h = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)
    else:
        g = g.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(g_ptr.dtype.element_ty).to(tl.float32)
        h = s * u.to(tl.float32)
    tl.store(out_ptr + r_R[:, None] * stride_or + i_I[None, :], h.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["T", "stride_wt", "stride_ot"])
def _weighted_sum_kernel(y_ptr, w_ptr, out_ptr, T, D, stride_wt, stride_ot, TOP_K: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, W_BITS: tl.constexpr, OUT_BITS: tl.constexpr):
    t_R = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d_D = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok_R = t_R < T
    ok = ok_R[:, None] & (d_D < D)[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for k in tl.static_range(TOP_K):  # slot order, one add at a time
        w = tl.load(w_ptr + t_R * stride_wt + k, mask=ok_R, other=0)
        w = (w.to(tl.int32) << 16).to(tl.float32, bitcast=True) if W_BITS else w.to(tl.float32)
        acc += w[:, None] * tl.load(y_ptr + (t_R[:, None] * TOP_K + k) * D + d_D[None, :], mask=ok, other=0.0)
    if OUT_BITS:
        b = acc.to(tl.int32, bitcast=True)
        acc = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)
    tl.store(out_ptr + t_R[:, None] * stride_ot + d_D[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _attn_split(q_RC, n_R, k_ptr, v_ptr, table_ptr, b, g, j_lo, j_hi, page, scale,
                stride_kb, stride_kg, stride_kl, stride_vb, stride_vg, stride_vl, stride_tb, c_C, ok_C,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                KV_BITS: tl.constexpr, F32_DOT: tl.constexpr, DOT: tl.constexpr):
    """One KV split's partial softmax for the rows q_RC: (max, sum of exp, sum of exp * v) over keys
    j_lo <= j < j_hi that each row may see (j < n_R), walked in BLOCK_N blocks from j_lo. The one
    definition both attention paths run, so a split's partial is the same bits in either."""
    m_R = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_R = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        j_N = j0 + tl.arange(0, BLOCK_N)
        ok_N = j_N < j_hi
        if PAGED:  # key j of sequence b sits in slot tables[b, j // page] * page + j % page
            blk = tl.load(table_ptr + b * stride_tb + j_N // page, mask=ok_N, other=0).to(tl.int64)
            slot = blk * page + j_N % page
            k_rows = slot * stride_kl + g * stride_kg
            v_rows = slot * stride_vl + g * stride_vg
        else:
            k_rows = b * stride_kb + g * stride_kg + j_N.to(tl.int64) * stride_kl
            v_rows = b * stride_vb + g * stride_vg + j_N.to(tl.int64) * stride_vl
        mask = ok_N[:, None] & ok_C[None, :]
        k_NC = tl.load(k_ptr + k_rows[:, None] + c_C[None, :], mask=mask, other=0)  # masked keys: 0, never garbage
        v_NC = tl.load(v_ptr + v_rows[:, None] + c_C[None, :], mask=mask, other=0)
        if KV_BITS:
            k_NC = (k_NC.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            v_NC = (v_NC.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            k_NC = k_NC.to(tl.float32)
            v_NC = v_NC.to(tl.float32)
        if F32_DOT:
            s_RN = tl.dot(q_RC, tl.trans(k_NC), input_precision="ieee")
        else:
            s_RN = tl.dot(q_RC.to(DOT), tl.trans(k_NC.to(DOT)))
        s_RN = tl.where(j_N[None, :] < n_R[:, None], s_RN * scale, float("-inf"))
        m_new = tl.maximum(m_R, tl.max(s_RN, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: factors 0, not -inf - -inf
        alpha = tl.exp(m_R - m_safe)
        p_RN = tl.exp(s_RN - m_safe[:, None])
        l_R = l_R * alpha + tl.sum(p_RN, 1)
        if F32_DOT:
            pv = tl.dot(p_RN, v_NC, input_precision="ieee")
        else:
            pv = tl.dot(p_RN.to(DOT), v_NC.to(DOT))
        acc = acc * alpha[:, None] + pv
        m_R = m_new
    return m_R, l_R, acc


@triton.jit
def _attn_rows(len_ptr, b, q0, g, Q, GROUP, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    """A program's rows: BLOCK_T queries of sequence b times the GROUP q heads of kv head g (the rows of the
    dots; a row's dot products do not depend on the other rows), each with its own key count."""
    r_R = tl.arange(0, BLOCK_T * BLOCK_G)
    t_R = q0 + r_R // BLOCK_G
    h_R = g * GROUP + r_R % BLOCK_G
    ok_R = (t_R < Q) & (r_R % BLOCK_G < GROUP)
    n_R = tl.load(len_ptr + b * Q + t_R, mask=ok_R, other=0)
    return t_R, h_R, ok_R, n_R


@triton.jit
def _attn_query(q_ptr, b, t_R, h_R, ok_R, c_C, ok_C, stride_qb, stride_qq, stride_qh, Q_BITS: tl.constexpr):
    """The rows' queries in float32 (bf16 widened by its bits), as both attention kernels read them."""
    q_RC = tl.load(q_ptr + b * stride_qb + t_R[:, None] * stride_qq + h_R[:, None] * stride_qh + c_C[None, :],
                   mask=ok_R[:, None] & ok_C[None, :], other=0)
    return (q_RC.to(tl.int32) << 16).to(tl.float32, bitcast=True) if Q_BITS else q_RC.to(tl.float32)


@triton.jit
def _merge_split(big_m, big_l, big_a, m_R, l_R, acc):
    """One split's (max, sum, weighted values) folded into the running ones: the one merge that the
    single-program and the split-parallel attention both use, so their arithmetic is the same."""
    m_new = tl.maximum(big_m, m_R)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(big_m - m_safe)
    c = tl.exp(m_R - m_safe)
    return m_new, big_l * a + l_R * c, big_a * a[:, None] + acc * c[:, None]


@triton.jit
def _attn_store(o_ptr, o, b, t_R, h_R, ok_R, c_C, ok_C, stride_ob, stride_oq, stride_oh, O_BITS: tl.constexpr):
    if O_BITS:
        bits = o.to(tl.int32, bitcast=True)
        o = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
    tl.store(o_ptr + b * stride_ob + t_R[:, None] * stride_oq + h_R[:, None] * stride_oh + c_C[None, :],
             o.to(o_ptr.dtype.element_ty), mask=ok_R[:, None] & ok_C[None, :])


@triton.jit(do_not_specialize=["Q", "stride_qb", "stride_qq", "stride_kb", "stride_vb", "stride_ob", "stride_oq",
                               "stride_tb"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, len_ptr, table_ptr, Q, GROUP, scale, page,
                      stride_qb, stride_qq, stride_qh, stride_kb, stride_kg, stride_kl, stride_vb, stride_vg,
                      stride_vl, stride_ob, stride_oq, stride_oh, stride_tb,
                      C, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
                      BLOCK_N: tl.constexpr, PAGED: tl.constexpr, Q_BITS: tl.constexpr, KV_BITS: tl.constexpr,
                      F32_DOT: tl.constexpr, DOT: tl.constexpr):
    # Program (b, tile, g): every KV split of its rows in turn, each split's partial merged in split order
    # (what _attention_combine_kernel does with the partials _attention_split_kernel writes in parallel).
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(2)
    t_R, h_R, ok_R, n_R = _attn_rows(len_ptr, b, tl.program_id(1) * BLOCK_T, g, Q, GROUP, BLOCK_T, BLOCK_G)
    c_C = tl.arange(0, BLOCK_C)
    ok_C = c_C < C
    q_RC = _attn_query(q_ptr, b, t_R, h_R, ok_R, c_C, ok_C, stride_qb, stride_qq, stride_qh, Q_BITS)
    big_m = tl.full((BLOCK_T * BLOCK_G,), float("-inf"), tl.float32)
    big_l = tl.zeros((BLOCK_T * BLOCK_G,), tl.float32)
    big_a = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_C), tl.float32)
    n_max = tl.max(n_R, 0)
    for s0 in range(0, n_max, SPLIT):  # a split past a row's own count is an exact no-op for that row
        m_R, l_R, acc = _attn_split(q_RC, n_R, k_ptr, v_ptr, table_ptr, b, g, s0, tl.minimum(s0 + SPLIT, n_max),
                                    page, scale, stride_kb, stride_kg, stride_kl, stride_vb, stride_vg, stride_vl,
                                    stride_tb, c_C, ok_C, BLOCK_T * BLOCK_G, BLOCK_C, BLOCK_N, PAGED, KV_BITS,
                                    F32_DOT, DOT)
        big_m, big_l, big_a = _merge_split(big_m, big_l, big_a, m_R, l_R, acc)
    _attn_store(o_ptr, big_a / tl.where(big_l > 0, big_l, 1.0)[:, None], b, t_R, h_R, ok_R, c_C, ok_C,
                stride_ob, stride_oq, stride_oh, Q_BITS)


@triton.jit(do_not_specialize=["Q", "stride_qb", "stride_qq", "stride_kb", "stride_vb", "stride_tb"])
def _attention_split_kernel(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, a_ptr, len_ptr, table_ptr, Q, GROUP, scale, page,
                            stride_qb, stride_qq, stride_qh, stride_kb, stride_kg, stride_kl, stride_vb, stride_vg,
                            stride_vl, stride_tb, H, S,
                            C, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, Q_BITS: tl.constexpr,
                            KV_BITS: tl.constexpr, F32_DOT: tl.constexpr, DOT: tl.constexpr):
    # Program (b, tile, g * S + split): one split's partial, into m/l [B, Q, H, S] and a [B, Q, H, S, C].
    # Decode only (Q = 1): a split past the sequence's keys writes nothing (the combine stops before it).
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(2) // S
    sp = tl.program_id(2) % S
    if sp * SPLIT >= tl.load(len_ptr + b * Q):
        return
    t_R, h_R, ok_R, n_R = _attn_rows(len_ptr, b, tl.program_id(1) * BLOCK_T, g, Q, GROUP, BLOCK_T, BLOCK_G)
    c_C = tl.arange(0, BLOCK_C)
    ok_C = c_C < C
    q_RC = _attn_query(q_ptr, b, t_R, h_R, ok_R, c_C, ok_C, stride_qb, stride_qq, stride_qh, Q_BITS)
    n_max = tl.max(n_R, 0)
    s0 = sp * SPLIT  # past every row's count: the loop runs no block and the partial is the empty one
    m_R, l_R, acc = _attn_split(q_RC, n_R, k_ptr, v_ptr, table_ptr, b, g, s0, tl.minimum(s0 + SPLIT, n_max),
                                page, scale, stride_kb, stride_kg, stride_kl, stride_vb, stride_vg, stride_vl,
                                stride_tb, c_C, ok_C, BLOCK_T * BLOCK_G, BLOCK_C, BLOCK_N, PAGED, KV_BITS,
                                F32_DOT, DOT)
    idx_R = ((b * Q + t_R) * H + h_R) * S + sp
    tl.store(m_ptr + idx_R, m_R, mask=ok_R)
    tl.store(l_ptr + idx_R, l_R, mask=ok_R)
    tl.store(a_ptr + idx_R[:, None] * C + c_C[None, :], acc, mask=ok_R[:, None] & ok_C[None, :])


@triton.jit(do_not_specialize=["Q", "stride_ob", "stride_oq"])
def _attention_combine_kernel(m_ptr, l_ptr, a_ptr, o_ptr, len_ptr, Q, GROUP, H, S,
                              stride_ob, stride_oq, stride_oh, C, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, O_BITS: tl.constexpr):
    # Program (b, tile, g): the S partials merged in split order, as _attention_kernel merges them.
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(2)
    t_R, h_R, ok_R, n_R = _attn_rows(len_ptr, b, tl.program_id(1) * BLOCK_T, g, Q, GROUP, BLOCK_T, BLOCK_G)
    c_C = tl.arange(0, BLOCK_C)
    ok_C = c_C < C
    big_m = tl.full((BLOCK_T * BLOCK_G,), float("-inf"), tl.float32)
    big_l = tl.zeros((BLOCK_T * BLOCK_G,), tl.float32)
    big_a = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_C), tl.float32)
    base_R = ((b * Q + t_R) * H + h_R) * S
    for sp in range(0, tl.cdiv(tl.max(n_R, 0), SPLIT)):  # the splits that hold keys; the rest are empty
        m_R = tl.load(m_ptr + base_R + sp, mask=ok_R, other=float("-inf"))
        l_R = tl.load(l_ptr + base_R + sp, mask=ok_R, other=0.0)
        acc = tl.load(a_ptr + (base_R + sp)[:, None] * C + c_C[None, :], mask=ok_R[:, None] & ok_C[None, :],
                      other=0.0)
        big_m, big_l, big_a = _merge_split(big_m, big_l, big_a, m_R, l_R, acc)
    _attn_store(o_ptr, big_a / tl.where(big_l > 0, big_l, 1.0)[:, None], b, t_R, h_R, ok_R, c_C, ok_C,
                stride_ob, stride_oq, stride_oh, O_BITS)


# ---------------------------------------------------------------- wrappers


def _bits(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(what to hand the kernel, whether it is bfloat16 as int16 bits: the interpreter has no bf16 math)."""
    if interpreting() and t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    return t, False


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [R, last] with unit stride in the last dimension (a view where it can be)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _f32_dot(activations: torch.dtype) -> bool:
    """float32 MMA (ieee) for float32 activations or under the interpreter; else the activations' dtype,
    weights cast to it: float32 weights that hold bf16 values (the trainer's fake-quantized MXFP8 masters)
    then multiply exactly as the server's MXFP8 experts dequantized in registers do."""
    return interpreting() or activations == torch.float32


def matmul(x: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K].T (+ bias) -> [..., N] in out_dtype (default x's), float32 accumulation."""
    K = x.shape[-1]
    if w_NK.dim() != 2 or w_NK.shape[1] != K:
        raise ValueError(f"matmul: x [..., {K}] against w {tuple(w_NK.shape)}: want w [N, {K}]")
    a = _rows(x)
    w = w_NK if w_NK.stride(-1) == 1 else w_NK.contiguous()
    M, N = a.shape[0], w.shape[0]
    out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M and N:
        BM, BN, BK = tiles(N)
        (a_k, a_bits), (w_k, w_bits), (o_k, o_bits) = _bits(a), _bits(w), _bits(out)
        with launch("batch_invariant.matmul"):
            _mm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
                a_k, w_k, w_k, bias_N if bias_N is not None else w_k, o_k, a_k, a_k, a_k,
                M, N, K, a.stride(0), 0, w.stride(0), 0, 0, out.stride(0),
                A_DIV=1, GROUPED=False, MX=False, HAS_BIAS=bias_N is not None, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                A_BITS=a_bits, W_BITS=w_bits, OUT_BITS=o_bits, F32_DOT=_f32_dot(x.dtype),
                DOT=_DOT.get(x.dtype, tl.float32), enable_fp_fusion=False)
    return out.view(*x.shape[:-1], N)


def _grouped(a: torch.Tensor, w, pairs, out_dtype: torch.dtype, a_div: int, mx_in_kernel: bool = False) -> torch.Tensor:
    """One expert matmul over kernels/moe_align.py's sorted pairs: out [pairs, N]."""
    mx = isinstance(w, MXFP8Tensor)
    if mx and (a.dtype == torch.float16 or (interpreting() and not mx_in_kernel)):
        # mx_dot multiplies in bf16, which would round fp16 activations. The interpreter pays ~5 ms per
        # call of a jit helper: float32 values there are the same numbers (the tests check mx_in_kernel).
        w, mx = w.dequantize(torch.float32 if interpreting() else a.dtype, backend="torch"), False
    data = w.data if mx else w
    E, N, K = data.shape
    a = a if a.stride(-1) == 1 else a.contiguous()
    out = torch.empty((pairs.num_pairs, N), dtype=out_dtype, device=a.device)
    BM, BN, BK = tiles(N)
    (a_k, a_bits), (w_k, w_bits), (o_k, o_bits) = _bits(a), _bits(data), _bits(out)
    s = w.scales.view(torch.uint8) if mx else data  # E8M0 bytes (triton has no float8_e8m0fnu)
    with launch("batch_invariant.grouped_matmul"):
        _mm_kernel[(pairs.sorted_pair_ids.numel() // BM, triton.cdiv(N, BN))](
            a_k, w_k, s, w_k, o_k, pairs.sorted_pair_ids, pairs.block_expert, pairs.num_padded,
            pairs.num_pairs, N, K, a.stride(0), data.stride(0), data.stride(1), s.stride(0) if mx else 0,
            s.stride(1) if mx else 0, out.stride(0),
            A_DIV=a_div, GROUPED=True, MX=mx, HAS_BIAS=False, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
            A_BITS=a_bits, W_BITS=w_bits, OUT_BITS=o_bits, F32_DOT=_f32_dot(a.dtype),
            DOT=_DOT.get(a.dtype, tl.float32), enable_fp_fusion=False)
    return out


def moe(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, w13, w2,
        mx_in_kernel: bool = False) -> torch.Tensor:
    """The routed experts: w13 [E, 2I, D] and w2 [E, D, I], plain or MXFP8Tensor; [T, D] in x's dtype.
    MXFP8 weights are dequantized in the kernel on a GPU (or with `mx_in_kernel`), on the host under the
    interpreter: the same numbers either way."""
    T, D = x_TD.shape
    K = ids_TK.shape[1]
    E, inter = w13.shape[0], w2.shape[2]
    if tuple(w13.shape) != (E, 2 * inter, D) or tuple(w2.shape) != (E, D, inter):
        raise ValueError(f"moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x [T, {D}]")
    out = torch.empty_like(x_TD)
    if T == 0:
        return out
    pairs = moe_align_block_size(ids_TK, tiles()[0], E)
    gate_up = _grouped(x_TD, w13, pairs, x_TD.dtype, K, mx_in_kernel)  # [T*K, 2I]
    h = silu_mul(gate_up[:, :inter], gate_up[:, inter:])
    y = _grouped(h, w2, pairs, torch.float32, 1, mx_in_kernel)  # [T*K, D], kept in float32 for the sum
    return weighted_sum(y.view(T, K, D), weights_TK)


def _block_rows() -> int:
    """Rows per program of the row kernels: one on a GPU (vLLM's and Thinking Machines' choice); 16 under
    the interpreter, which pays per program (numpy sums each row of a [16, D] block alone)."""
    return 16 if interpreting() else 1


def weighted_sum(y_TKD: torch.Tensor, weights_TK: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * y[t, k] in float32, k in order; y float32 [T, K, D]; out in weights' dtype."""
    T, K, D = y_TKD.shape
    y = y_TKD.contiguous()
    w = weights_TK if weights_TK.stride(-1) == 1 else weights_TK.contiguous()
    out = torch.empty((T, D), dtype=out_dtype or weights_TK.dtype, device=y.device)
    if T:
        (w_k, w_bits), (o_k, o_bits) = _bits(w), _bits(out)
        block, rows = min(1024, triton.next_power_of_2(D)), _block_rows()
        with launch("batch_invariant.weighted_sum"):
            _weighted_sum_kernel[(triton.cdiv(T, rows), triton.cdiv(D, block))](
                y, w_k, o_k, T, D, w.stride(0), out.stride(0), TOP_K=K, BLOCK_R=rows, BLOCK_D=block,
                W_BITS=w_bits, OUT_BITS=o_bits, enable_fp_fusion=False)
    return out


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x) rounded to x's dtype) over the last dim; out in promote(weight, x)."""
    D = x.shape[-1]
    rows = _rows(x)
    R = rows.shape[0]
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight_D.dtype, x.dtype), device=x.device)
    if R:
        (x_k, x_bits), (w_k, w_bits), (o_k, o_bits) = _bits(rows), _bits(weight_D.contiguous()), _bits(out)
        with launch("batch_invariant.rms_norm"):
            _rms_norm_kernel[(triton.cdiv(R, _block_rows()),)](
                x_k, w_k, o_k, R, D, eps, rows.stride(0), out.stride(0), BLOCK_R=_block_rows(),
                BLOCK_D=triton.next_power_of_2(D), X_BITS=x_bits, W_BITS=w_bits, OUT_BITS=o_bits,
                enable_fp_fusion=False)
    return out.view(x.shape)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 log_softmax over the last dim, each row alone, in fixed blocks of its columns."""
    V = x.shape[-1]
    rows = _rows(x)
    R = rows.shape[0]
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if R:
        x_k, x_bits = _bits(rows)
        with launch("batch_invariant.log_softmax"):
            _log_softmax_kernel[(triton.cdiv(R, _block_rows()),)](
                x_k, out, R, V, rows.stride(0), out.stride(0), BLOCK_R=_block_rows(),
                BLOCK_V=min(1024, triton.next_power_of_2(V)), X_BITS=x_bits, enable_fp_fusion=False)
    return out.view(x.shape)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) (rounded to g's dtype) * u, rounded: SwiGLU's elementwise part."""
    if g.shape != u.shape or g.dtype != u.dtype:
        raise ValueError(f"silu_mul: g {tuple(g.shape)} {g.dtype} and u {tuple(u.shape)} {u.dtype} differ")
    width = g.shape[-1]
    g2, u2 = _rows(g), _rows(u)
    R = g2.shape[0]
    out = torch.empty(g2.shape, dtype=g.dtype, device=g.device)
    if R:
        (g_k, bits), (u_k, _), (o_k, _) = _bits(g2), _bits(u2), _bits(out)
        block, rows = min(1024, triton.next_power_of_2(width)), _block_rows()
        with launch("batch_invariant.silu_mul"):
            _silu_mul_kernel[(triton.cdiv(R, rows), triton.cdiv(width, block))](
                g_k, u_k, o_k, R, width, g2.stride(0), u2.stride(0), out.stride(0), BLOCK_R=rows, BLOCK_I=block,
                BITS=bits, enable_fp_fusion=False)
    return out.view(g.shape)


def attention(q_BQHC: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens_BQ: torch.Tensor,
              tables_BN: torch.Tensor | None = None, page: int = 0) -> torch.Tensor:
    """softmax(q k^T / sqrt(C)) v: query (b, i) sees keys 0..lens[b, i]-1 of sequence b: [B, Q, H, C].

    K/V dense [B, G, L, C] (any strides, unit stride in C), or with `tables_BN` the paged cache
    [slots, G, C] whose key j of sequence b sits at slot tables[b, j // page] * page + j % page."""
    B, Q, H, C = q_BQHC.shape
    G = k.shape[1]
    if H % G or k.shape != v.shape or k.shape[-1] != C or tuple(lens_BQ.shape) != (B, Q):
        raise ValueError(f"attention: q {tuple(q_BQHC.shape)} against k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"lens {tuple(lens_BQ.shape)}")
    q = q_BQHC if q_BQHC.stride(-1) == 1 else q_BQHC.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    lens = lens_BQ.to(torch.int32).contiguous()
    out = torch.empty((B, Q, H, C), dtype=q.dtype, device=q.device)
    if B * Q == 0:
        return out
    paged = tables_BN is not None
    if paged:
        strides = (0, k.stride(1), k.stride(0), 0, v.stride(1), v.stride(0))
    else:
        strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    (q_k, q_bits), (k_k, kv_bits), (v_k, _), (o_k, _) = _bits(q), _bits(k), _bits(v), _bits(out)
    tables = tables_BN if paged else lens
    group = H // G
    # rows of a dot: BLOCK_T queries x the group's heads, at least 16 on a GPU (tl.dot's smallest M)
    block_g = triton.next_power_of_2(group)
    block_t = max(1, 16 // block_g)
    grid = (B, triton.cdiv(Q, block_t), G)
    common = dict(BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_C=triton.next_power_of_2(C))
    kernel = dict(SPLIT=ATTN_SPLIT, BLOCK_N=ATTN_BLOCK_N, PAGED=paged, Q_BITS=q_bits, KV_BITS=kv_bits,
                  F32_DOT=_f32_dot(q.dtype), DOT=_DOT.get(q.dtype, tl.float32), **common)
    splits = triton.cdiv(tables_BN.shape[1] * page if paged else k.shape[2], ATTN_SPLIT)
    # The two paths give the same bits (the same split code and merge), so the choice is only speed: a
    # decode step's sequences run their splits in parallel unless the cache is so long that the partials'
    # buffer ([B, H, splits, C] float32) and the mostly idle programs past short sequences cost more.
    if Q > 1 or splits == 1 or splits > MAX_PARALLEL_SPLITS:  # prefill, whole sequences: splits in turn
        with launch("batch_invariant.attention"):
            _attention_kernel[grid](
                q_k, k_k, v_k, o_k, lens, tables, Q, group, C ** -0.5, max(page, 1),
                q.stride(0), q.stride(1), q.stride(2), *strides, out.stride(0), out.stride(1), out.stride(2),
                tables.stride(0) if paged else 0, C, **kernel, enable_fp_fusion=False)
        return out
    # decode (one query a sequence): the splits in parallel, then merged in the same order
    m = torch.empty((B, Q, H, splits), dtype=torch.float32, device=q.device)
    lsum, acc = torch.empty_like(m), torch.empty((B, Q, H, splits, C), dtype=torch.float32, device=q.device)
    with launch("batch_invariant.attention_splits"):
        _attention_split_kernel[(B, grid[1], G * splits)](
            q_k, k_k, v_k, m, lsum, acc, lens, tables, Q, group, C ** -0.5, max(page, 1),
            q.stride(0), q.stride(1), q.stride(2), *strides, tables.stride(0) if paged else 0, H, splits, C,
            **kernel, enable_fp_fusion=False)
    with launch("batch_invariant.attention_combine"):
        _attention_combine_kernel[grid](m, lsum, acc, o_k, lens, Q, group, H, splits, out.stride(0), out.stride(1),
                                        out.stride(2), C, SPLIT=ATTN_SPLIT, O_BITS=q_bits, **common,
                                        enable_fp_fusion=False)
    return out
