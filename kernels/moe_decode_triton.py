"""The MoE layer for a few tokens (decode), MXFP8 experts, in Triton: GEMV-shaped kernels, no sort.

At decode sizes (T <= DECODE_MAX_TOKENS tokens, T*K pairs) the layer is bound by reading the active
experts' weights, and the grouped kernels' alignment (sort the pairs by expert, pad each run to
BLOCK_M) costs kernels of its own and a BLOCK_M-row tile per expert. Here instead:

1. `_gate_up_kernel`, grid (T*K pair slots, I / BLOCK_N): slot j's program takes expert e = ids[j] and
   works only if j is the first slot routed to e (later ones return at once), so each active expert is
   read once, by I / BLOCK_N programs that each stream BLOCK_N gate rows and BLOCK_N up rows over D: fp8
   codes in wide [BLOCK_N, BLOCK_K] loads, their E8M0 scales one byte per 32 codes, dequantised in
   registers and multiplied against every token routed to e at once (a [BLOCK_T, BLOCK_K] tile of x,
   masked to those tokens: BLOCK_T >= 16 for tl.dot). The epilogue writes silu(gate) * up for each
   routed token into h at its pair's row (t * K + k).
2. `_down_kernel`, grid (T*K, D / BLOCK_N): the same first-slot rule, streams w2's rows over I, multiplies
   each routed token's h row, scales it by the pair's router weight, and writes the pair's row of a
   [T*K, D] float32 buffer; a torch sum over K finishes (deterministic, as kernels/moe_triton.py's).

Which tokens a program serves is found in registers from the [T, K] ids (a [BLOCK_T, BLOCK_KK] tile):
no data-dependent grid, nothing read on the host, so the layer is capturable in a CUDA graph. The
numerics are the grouped kernels': bf16 operands (float32 under the interpreter), float32
accumulation, h rounded to x's dtype.

Limits: the tile sizes are first guesses (no GPU was at hand to tune them; bench/kernels.py measures);
a token picks an expert at most once (as the router's top-k guarantees); D and I multiples of 32; only
the "dequant" matrix multiply (on sm_100 the grouped kernel's dot_scaled path still serves every size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import interpreting
from kernels.launches import launch
from kernels.mxfp8 import MXFP8Tensor
from kernels.mxfp8_triton import mx_rows_matmul, mx_swiglu_rows

DECODE_MAX_TOKENS = 16  # above this the grouped kernels' tiles win (crossover near 16 in the literature)


@triton.jit
def _routed(ids_ptr, stride_it, T, j, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KK: tl.constexpr):
    """Slot j's expert, the first slot routed to that expert, and per token row: routed to it, its pair id."""
    t_T = tl.arange(0, BLOCK_T)
    k_K = tl.arange(0, BLOCK_KK)
    ok_TK = (t_T < T)[:, None] & (k_K < TOP_K)[None, :]
    ids_TK = tl.load(ids_ptr + t_T[:, None] * stride_it + k_K[None, :], mask=ok_TK, other=-1)
    expert = tl.load(ids_ptr + (j // TOP_K) * stride_it + j % TOP_K)
    hit_TK = ok_TK & (ids_TK == expert)
    slot_TK = t_T[:, None] * TOP_K + k_K[None, :]
    first = tl.min(tl.where(hit_TK, slot_TK, BLOCK_T * TOP_K), axis=1)
    first_slot = tl.min(first, axis=0)
    hit_T = tl.max(hit_TK.to(tl.int32), axis=1) > 0
    pair_T = t_T * TOP_K + tl.sum(tl.where(hit_TK, k_K[None, :], 0), axis=1)
    return expert.to(tl.int64), first_slot, hit_T, pair_T.to(tl.int64)


@triton.jit
def tile_cols(axis: tl.constexpr, BLOCK_N: tl.constexpr, limit):
    """This program's BLOCK_N output columns along grid axis `axis`, and which lie below `limit`."""
    n_N = tl.program_id(axis) * BLOCK_N + tl.arange(0, BLOCK_N)
    return n_N, n_N < limit


@triton.jit
def weighted_rows_store(acc, weights_ptr, out_ptr, pair_T, hit_T, n_N, ok_N, stride_wt, stride_op,
                        TOP_K: tl.constexpr):
    """The down step's epilogue (every decode MoE kernel's): each routed token's row of acc [BLOCK_T, BLOCK_N]
    times its pair's router weight (weights [T, K] at (t, k) = (pair // K, pair % K)), stored as float32
    at the pair's row of out, columns n_N."""
    weight_T = tl.load(weights_ptr + (pair_T // TOP_K) * stride_wt + pair_T % TOP_K, mask=hit_T, other=0.0)
    acc = acc * weight_T.to(tl.float32)[:, None]
    tl.store(out_ptr + pair_T[:, None] * stride_op + n_N[None, :], acc, mask=hit_T[:, None] & ok_N[None, :])


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, h_ptr, T, D, INTER,
                    stride_xt, stride_it, stride_we, stride_wn, stride_se, stride_sn, stride_hp,
                    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    j = tl.program_id(0)
    expert, first_slot, hit_T, pair_T = _routed(ids_ptr, stride_it, T, j, TOP_K, BLOCK_T, BLOCK_KK)
    if first_slot != j:
        return  # another slot's programs read this expert
    n_N, ok_N = tile_cols(1, BLOCK_N, INTER)
    h_TN = mx_swiglu_rows(x_ptr, tl.arange(0, BLOCK_T).to(tl.int64), hit_T, stride_xt, w_ptr + expert * stride_we,
                          s_ptr + expert * stride_se, n_N, ok_N, D, INTER, stride_wn, stride_sn, BLOCK_T, BLOCK_N,
                          BLOCK_K, False, F32_DOT, False)
    tl.store(h_ptr + pair_T[:, None] * stride_hp + n_N[None, :], h_TN.to(h_ptr.dtype.element_ty),
             mask=hit_T[:, None] & ok_N[None, :])


@triton.jit
def _down_kernel(h_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, out_ptr, T, D, INTER,
                 stride_hp, stride_it, stride_wt, stride_we, stride_wn, stride_se, stride_sn, stride_op,
                 TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KK: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    j = tl.program_id(0)
    expert, first_slot, hit_T, pair_T = _routed(ids_ptr, stride_it, T, j, TOP_K, BLOCK_T, BLOCK_KK)
    if first_slot != j:
        return
    n_N, ok_N = tile_cols(1, BLOCK_N, D)
    acc = mx_rows_matmul(tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32), h_ptr, pair_T, hit_T, stride_hp,
                         w_ptr + expert * stride_we, s_ptr + expert * stride_se, n_N, ok_N, INTER, stride_wn,
                         stride_sn, BLOCK_T, BLOCK_N, BLOCK_K, False, F32_DOT, False)
    weighted_rows_store(acc, weights_ptr, out_ptr, pair_T, hit_T, n_N, ok_N, stride_wt, stride_op, TOP_K)


def decode_tiles(interpret: bool) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of gate_up and of down. On a GPU: narrow N tiles, so that
    8 active experts x (I / 16) gate_up programs and x (D / 32) down programs fill the SMs, and long K
    tiles (256 fp8 codes = 256 contiguous bytes per row) for wide loads. The interpreter pays per program:
    the widest tiles the test shapes allow."""
    if interpret:
        return (32, 64, 4, 1), (32, 64, 4, 1)
    return (16, 256, 4, 3), (32, 256, 4, 3)


def fused_moe_mxfp8_decode(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                           w13: MXFP8Tensor, w2: MXFP8Tensor, reduce: bool = True) -> torch.Tensor:
    """kernels.moe.moe_forward's MXFP8 path for T <= DECODE_MAX_TOKENS tokens (arguments checked there).
    reduce=False: the weighted float32 per-pair rows [T, K, D], not yet summed over K."""
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    inter = w2.shape[2]
    if T == 0:
        return x_TD.new_zeros((0, D)) if reduce else x_TD.new_zeros((0, K, D), dtype=torch.float32)
    if T > DECODE_MAX_TOKENS:
        raise ValueError(f"the decode MoE kernels take at most {DECODE_MAX_TOKENS} tokens, not {T}")
    interp = interpreting()
    x_TD = x_TD.contiguous()
    ids_TK = topk_ids_TK if topk_ids_TK.stride(1) == 1 else topk_ids_TK.contiguous()
    weights_TK = topk_weights_TK if topk_weights_TK.stride(1) == 1 else topk_weights_TK.contiguous()
    w13_data, w13_scales = w13.data.contiguous(), w13.scales.contiguous().view(torch.uint8)
    w2_data, w2_scales = w2.data.contiguous(), w2.scales.contiguous().view(torch.uint8)
    # h in x's dtype, as a bf16 model rounds it (float32 under the interpreter, whose bf16 cast truncates)
    h_PI = torch.empty((T * K, inter), dtype=torch.float32 if interp else x_TD.dtype, device=x_TD.device)
    out_PD = torch.empty((T * K, D), dtype=torch.float32, device=x_TD.device)
    block_t = max(16, triton.next_power_of_2(T))
    block_kk = triton.next_power_of_2(K)
    (gn, gk, gw, gs), (dn, dk, dw, ds) = decode_tiles(interp)
    # a tile's width must be a power of two for the compiler (the loads mask what lies past D or I; the
    # interpreter accepts any width, so a D of 96 failed only on a GPU)
    gk, dk = min(gk, triton.next_power_of_2(D)), min(dk, triton.next_power_of_2(inter))
    with launch("moe_decode_gate_up"):
        _gate_up_kernel[(T * K, triton.cdiv(inter, gn))](
            x_TD, ids_TK, w13_data, w13_scales, h_PI, T, D, inter,
            x_TD.stride(0), ids_TK.stride(0), w13_data.stride(0), w13_data.stride(1), w13_scales.stride(0),
            w13_scales.stride(1), h_PI.stride(0),
            TOP_K=K, BLOCK_T=block_t, BLOCK_KK=block_kk, BLOCK_N=gn, BLOCK_K=gk, F32_DOT=interp,
            num_warps=gw, num_stages=gs)
    with launch("moe_decode_down"):
        _down_kernel[(T * K, triton.cdiv(D, dn))](
            h_PI, ids_TK, weights_TK, w2_data, w2_scales, out_PD, T, D, inter,
            h_PI.stride(0), ids_TK.stride(0), weights_TK.stride(0), w2_data.stride(0), w2_data.stride(1),
            w2_scales.stride(0), w2_scales.stride(1), out_PD.stride(0),
            TOP_K=K, BLOCK_T=block_t, BLOCK_KK=block_kk, BLOCK_N=dn, BLOCK_K=dk, F32_DOT=interp,
            num_warps=dw, num_stages=ds)
    return out_PD.view(T, K, D).sum(dim=1).to(x_TD.dtype) if reduce else out_PD.view(T, K, D)
