"""Triton kernels behind kernels/fused.py: add + RMSNorm, q/k RMSNorm + rotary + KV-cache write, and the
MoE router's softmax + top-k, each one launch (kernels/fused.py has the contract and the references).

Launch shapes: `_add_rms_norm_kernel` runs one program per row over BLOCK_D = next_power_of_2(D) lanes.
`_qk_norm_rope_cache_kernel` runs one program per (token, head) of the H q heads and G k heads; a head is
held as its two halves, since rotate-half pairs column c with c + C/2, and each k-head program also copies
its v head into the cache. `_router_topk_kernel` runs one program per row over BLOCK_E lanes and picks the
top k in k rounds of max, lowest index at the max, mask out. Grids depend on shapes only.

Numerics: every value is loaded and converted to the accumulation dtype (float32, float64 for float64
models) and every place where the model's torch code holds a tensor in the model dtype between two ops is
rounded to that dtype here too (`_rounded`), so the kernels compute the same roundings as the eager ops,
in the same order; only reductions (sums of squares, softmax sums) add in a different order. Floating
point contraction is turned off (`enable_fp_fusion=False`) because torch's `a * b + c * d` rounds each
product before the sum.

Under the Triton interpreter (no bfloat16 arithmetic; its float32 -> bfloat16 cast truncates and it
converts bfloat16 subnormals wrongly) bfloat16 tensors are handed over as their int16 bits and converted
with the nearest-even integer helpers of kernels/mxfp8_triton.py (`*_BITS` flags). On a GPU the flags are
off and the native casts (which round to nearest-even) run.

Limits: launch shapes (warps, one program per row or per head) are first guesses, not tuned on hardware;
the rows of the inputs must have unit stride in their last dimension (the wrappers copy otherwise, except
the caches, which are written in place and must have it); slots outside [0, num_slots) are not written
(the torch reference raises for them instead); eps reaches the kernels as a float32 scalar, so float64
models add eps rounded to float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import interpreting
from kernels.launches import launch
from kernels.moe_reference import acc_dtype
from kernels.mxfp8_triton import bf16_bits_to_float32, float32_to_bf16_bits

_TL_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}

# ---------------------------------------------------------------- jit helpers


@triton.jit
def _load(ptrs, mask, ACC: tl.constexpr, BITS: tl.constexpr):
    """Load and convert to ACC; BITS: the tensor is bfloat16 handed over as int16 bits."""
    v = tl.load(ptrs, mask=mask, other=0)
    if BITS:
        return bf16_bits_to_float32(v).to(ACC)
    return v.to(ACC)


@triton.jit
def _rounded(v, like_ptr, BITS: tl.constexpr):
    """v rounded to `like_ptr`'s dtype and held in v's: what an eager torch op in that dtype leaves."""
    if BITS:
        return bf16_bits_to_float32(float32_to_bf16_bits(v.to(tl.float32))).to(v.dtype)
    return v.to(like_ptr.dtype.element_ty).to(v.dtype)


@triton.jit
def _store(ptrs, v, mask, BITS: tl.constexpr):
    if BITS:
        tl.store(ptrs, float32_to_bf16_bits(v.to(tl.float32)), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- kernels


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, D, eps,
                         stride_xt, stride_xk, stride_rt, stride_ot, stride_st,
                         HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr, BLOCK_D: tl.constexpr,
                         ACC: tl.constexpr, X_BITS: tl.constexpr, W_BITS: tl.constexpr, OUT_BITS: tl.constexpr):
    # res_ptr is the model dtype's reference (the wrapper hands x itself over when there is no residual);
    # X_BITS says how that dtype is held.
    t = tl.program_id(0).to(tl.int64)
    d_D = tl.arange(0, BLOCK_D)
    ok_D = d_D < D
    if PARTS > 0:
        # x: a MoE layer's float32 per-pair rows [T, PARTS, D]; their sum in float32, k ascending, rounded
        # to the model dtype, is the layer's output (what the MoE path's `.sum(dim=1).to(dtype)` gives)
        p_D = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for k in tl.static_range(PARTS):
            p_D += tl.load(x_ptr + t * stride_xt + k * stride_xk + d_D, mask=ok_D, other=0.0).to(tl.float32)
        s_D = _rounded(p_D.to(ACC), res_ptr, X_BITS)
    else:
        s_D = _load(x_ptr + t * stride_xt + d_D, ok_D, ACC, X_BITS)
    if HAS_RESIDUAL:
        s_D = _rounded(s_D + _load(res_ptr + t * stride_rt + d_D, ok_D, ACC, X_BITS), res_ptr, X_BITS)
        _store(sum_ptr + t * stride_st + d_D, s_D, ok_D, X_BITS)
    # Padding lanes loaded 0, so they add nothing to the sum of squares.
    inv_rms = tl.math.rsqrt(tl.sum(s_D * s_D, 0) / D + eps)
    n_D = _rounded(s_D * inv_rms, res_ptr, X_BITS)
    w_D = _load(w_ptr + d_D, ok_D, ACC, W_BITS)
    _store(out_ptr + t * stride_ot + d_D, w_D * n_D, ok_D, OUT_BITS)


@triton.jit
def _qk_norm_rope_cache_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, q_ptr,
                               eps, num_slots, H, G,
                               stride_xt, stride_ct, stride_st, stride_kcs, stride_kcg, stride_vcs,
                               stride_vcg, stride_qt, stride_qh,
                               C: tl.constexpr, BLOCK_HALF: tl.constexpr, ACC: tl.constexpr,
                               X_BITS: tl.constexpr, W_BITS: tl.constexpr, KC_BITS: tl.constexpr,
                               VC_BITS: tl.constexpr):
    # Program (t, h): head h of token t, a q head for h < H, else k head g = h - H, whose program also
    # copies v head g. Everything is branch-free (masks), so each program runs the same instructions.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_q = h < H
    g = h - H
    HALF = C // 2
    c_C2 = tl.arange(0, BLOCK_HALF)
    ok_C2 = c_C2 < HALF
    # Scalar conditions enter masks through tl.where: the interpreter turns `block & scalar` into int32.
    ok_q = tl.where(is_q, ok_C2, False)
    ok_k = tl.where(is_q, False, ok_C2)
    # Rotate-half pairs column c with c + C/2, so the head is handled as its two halves.
    x_ptr = qkv_ptr + t * stride_xt + h * C
    x1 = _load(x_ptr + c_C2, ok_C2, ACC, X_BITS)
    x2 = _load(x_ptr + HALF + c_C2, ok_C2, ACC, X_BITS)
    w1 = tl.where(is_q, _load(qw_ptr + c_C2, ok_q, ACC, W_BITS), _load(kw_ptr + c_C2, ok_k, ACC, W_BITS))
    w2 = tl.where(is_q, _load(qw_ptr + HALF + c_C2, ok_q, ACC, W_BITS),
                  _load(kw_ptr + HALF + c_C2, ok_k, ACC, W_BITS))
    inv_rms = tl.math.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / C + eps)
    # RMSNorm rounds x / rms to the model dtype, then the weight product (the reference's `.to(dtype)`).
    y1 = _rounded(w1 * _rounded(x1 * inv_rms, q_ptr, X_BITS), q_ptr, X_BITS)
    y2 = _rounded(w2 * _rounded(x2 * inv_rms, q_ptr, X_BITS), q_ptr, X_BITS)
    cos1 = _load(cos_ptr + t * stride_ct + c_C2, ok_C2, ACC, X_BITS)
    cos2 = _load(cos_ptr + t * stride_ct + HALF + c_C2, ok_C2, ACC, X_BITS)
    sin1 = _load(sin_ptr + t * stride_st + c_C2, ok_C2, ACC, X_BITS)
    sin2 = _load(sin_ptr + t * stride_st + HALF + c_C2, ok_C2, ACC, X_BITS)
    # apply_rope: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the model dtype.
    o1 = _rounded(_rounded(y1 * cos1, q_ptr, X_BITS) + _rounded(-y2 * sin1, q_ptr, X_BITS), q_ptr, X_BITS)
    o2 = _rounded(_rounded(y2 * cos2, q_ptr, X_BITS) + _rounded(y1 * sin2, q_ptr, X_BITS), q_ptr, X_BITS)

    q_dst = q_ptr + t * stride_qt + h * stride_qh
    _store(q_dst + c_C2, o1, ok_q, X_BITS)
    _store(q_dst + HALF + c_C2, o2, ok_q, X_BITS)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Out-of-range slots are never written: a memory fault inside a CUDA graph is worse than a lost row.
    ok_kv = tl.where((slot >= 0) & (slot < num_slots), ok_k, False)
    k_dst = kc_ptr + slot * stride_kcs + g * stride_kcg
    _store(k_dst + c_C2, o1, ok_kv, KC_BITS)
    _store(k_dst + HALF + c_C2, o2, ok_kv, KC_BITS)
    v_src = qkv_ptr + t * stride_xt + (H + G + g) * C
    v_dst = vc_ptr + slot * stride_vcs + g * stride_vcg
    _store(v_dst + c_C2, _load(v_src + c_C2, ok_kv, ACC, X_BITS), ok_kv, VC_BITS)
    _store(v_dst + HALF + c_C2, _load(v_src + HALF + c_C2, ok_kv, ACC, X_BITS), ok_kv, VC_BITS)


@triton.jit
def _router_topk_kernel(logits_ptr, w_ptr, ids_ptr, routes_ptr, slot_ptr, E, layer, num_slots,
                        stride_lt, stride_wt, stride_it, stride_rs, stride_rm,
                        TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        RENORMALIZE: tl.constexpr, RECORD: tl.constexpr, ACC: tl.constexpr,
                        L_BITS: tl.constexpr, W_BITS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e_E = tl.arange(0, BLOCK_E)
    ok_E = e_E < E
    x_E = tl.where(ok_E, _load(logits_ptr + t * stride_lt + e_E, ok_E, ACC, L_BITS), -float("inf"))
    p_E = tl.exp(x_E - tl.max(x_E, 0))
    p_E = p_E / tl.sum(p_E, 0)
    # Probabilities are >= 0, so -1 marks lanes never to pick again: padding now, each pick below.
    p_E = tl.where(ok_E, p_E, -1.0)
    k_K = tl.arange(0, BLOCK_K)
    w_K = tl.zeros((BLOCK_K,), dtype=ACC)
    id_K = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p_E, 0)
        # The lowest index among equal probabilities, as torch.topk orders ties on a CPU.
        pick = tl.min(tl.where(p_E == best, e_E, BLOCK_E), 0)
        w_K = tl.where(k_K == i, best, w_K)
        id_K = tl.where(k_K == i, pick, id_K)
        p_E = tl.where(e_E == pick, -1.0, p_E)
    if RENORMALIZE:
        w_K = w_K / tl.sum(w_K, 0)  # lanes k >= TOP_K hold 0
    ok_K = k_K < TOP_K
    _store(w_ptr + t * stride_wt + k_K, w_K, ok_K, W_BITS)
    tl.store(ids_ptr + t * stride_it + k_K, id_K.to(tl.int64), mask=ok_K)
    if RECORD:  # routing replay: the picks at the token's cache slot, this layer's row (slots outside: skipped)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        ok_R = tl.where((slot >= 0) & (slot < num_slots), ok_K, False)  # a scalar enters a mask via where
        tl.store(routes_ptr + slot * stride_rs + layer * stride_rm + k_K,
                 id_K.to(routes_ptr.dtype.element_ty), mask=ok_R)


# ---------------------------------------------------------------- wrappers


def _bits(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(what to hand the kernel, whether it is bfloat16 as int16 bits): see the module docstring."""
    if interpreting() and t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    return t, False


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def add_rms_norm_triton(x_TD: torch.Tensor, residual_TD: torch.Tensor | None, weight_D: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.fused.add_rms_norm's kernel path (which checks the arguments); x may be [T, K, D] float32
    per-pair rows (then with a residual)."""
    parts = x_TD.shape[1] if x_TD.dim() == 3 else 0
    T, D = x_TD.shape[0], x_TD.shape[-1]
    x_TD = _unit_stride(x_TD)
    dtype = x_TD.dtype if residual_TD is None else residual_TD.dtype
    out_TD = torch.empty((T, D), dtype=torch.promote_types(weight_D.dtype, dtype), device=x_TD.device)
    sum_TD = x_TD if residual_TD is None else torch.empty((T, D), dtype=dtype, device=x_TD.device)
    res_TD = x_TD if residual_TD is None else _unit_stride(residual_TD)
    if T == 0:
        return out_TD, sum_TD
    (x_k, _), (res_k, res_bits), (w_k, w_bits) = _bits(x_TD), _bits(res_TD), _bits(weight_D.contiguous())
    (out_k, out_bits), (sum_k, _) = _bits(out_TD), _bits(sum_TD)
    block_d = triton.next_power_of_2(D)
    with launch("add_rms_norm"):
        _add_rms_norm_kernel[(T,)](
            x_k, res_k, w_k, out_k, sum_k, D, eps,
            x_TD.stride(0), x_TD.stride(1) if parts else 0, res_TD.stride(0), out_TD.stride(0), sum_TD.stride(0),
            HAS_RESIDUAL=residual_TD is not None, PARTS=parts, BLOCK_D=block_d, ACC=_TL_ACC[acc_dtype(dtype)],
            X_BITS=res_bits, W_BITS=w_bits, OUT_BITS=out_bits,
            num_warps=4 if block_d <= 1024 else 8 if block_d <= 4096 else 16, enable_fp_fusion=False)
    return out_TD, sum_TD


def qk_norm_rope_cache_triton(qkv_TN: torch.Tensor, q_norm_w_C: torch.Tensor, k_norm_w_C: torch.Tensor,
                              eps: float, cos_TC: torch.Tensor, sin_TC: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slot_mapping_T: torch.Tensor, num_heads: int) -> torch.Tensor:
    """kernels.fused.qk_norm_rope_cache's kernel path (which checks the arguments)."""
    T = qkv_TN.shape[0]
    C = q_norm_w_C.shape[0]
    H = num_heads
    G = (qkv_TN.shape[1] // C - H) // 2
    qkv_TN, cos_TC, sin_TC = _unit_stride(qkv_TN), _unit_stride(cos_TC), _unit_stride(sin_TC)
    q_THC = torch.empty((T, H, C), dtype=qkv_TN.dtype, device=qkv_TN.device)
    if T == 0:
        return q_THC
    (x_k, x_bits), (q_k, _) = _bits(qkv_TN), _bits(q_THC)
    (qw_k, w_bits), (kw_k, _) = _bits(q_norm_w_C.contiguous()), _bits(k_norm_w_C.contiguous())
    (cos_k, _), (sin_k, _) = _bits(cos_TC), _bits(sin_TC)
    (kc_k, kc_bits), (vc_k, vc_bits) = _bits(k_cache), _bits(v_cache)
    block_half = triton.next_power_of_2(C // 2)
    with launch("qk_norm_rope_cache"):
        _qk_norm_rope_cache_kernel[(T, H + G)](
            x_k, qw_k, kw_k, cos_k, sin_k, kc_k, vc_k, slot_mapping_T.contiguous(), q_k,
            eps, k_cache.shape[0], H, G,
            qkv_TN.stride(0), cos_TC.stride(0), sin_TC.stride(0), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), q_THC.stride(0), q_THC.stride(1),
            C=C, BLOCK_HALF=block_half, ACC=_TL_ACC[acc_dtype(qkv_TN.dtype)],
            X_BITS=x_bits, W_BITS=w_bits, KC_BITS=kc_bits, VC_BITS=vc_bits,
            num_warps=1 if block_half <= 64 else 2, enable_fp_fusion=False)
    return q_THC


def router_topk_triton(logits_TE: torch.Tensor, top_k: int, renormalize: bool,
                       record: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.fused.router_topk's kernel path (which checks the arguments)."""
    T, E = logits_TE.shape
    logits_TE = _unit_stride(logits_TE)
    weights_TK = torch.empty((T, top_k), dtype=logits_TE.dtype, device=logits_TE.device)
    ids_TK = torch.empty((T, top_k), dtype=torch.int64, device=logits_TE.device)
    if T == 0:
        return weights_TK, ids_TK
    (l_k, l_bits), (w_k, w_bits) = _bits(logits_TE), _bits(weights_TK)
    routes_SMK, slots_T, layer = record if record is not None else (ids_TK, ids_TK, 0)
    block_e = triton.next_power_of_2(E)
    with launch("router_topk"):
        _router_topk_kernel[(T,)](
            l_k, w_k, ids_TK, routes_SMK, slots_T.contiguous(), E, layer, routes_SMK.shape[0],
            logits_TE.stride(0), weights_TK.stride(0), ids_TK.stride(0), routes_SMK.stride(0),
            routes_SMK.stride(1),
            TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
            RECORD=record is not None, ACC=_TL_ACC[acc_dtype(logits_TE.dtype)], L_BITS=l_bits, W_BITS=w_bits,
            num_warps=max(1, min(4, block_e // 256)), enable_fp_fusion=False)
    return weights_TK, ids_TK
