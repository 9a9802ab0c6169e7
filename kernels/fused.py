"""Fused ops of a GPU decode step: each replaces a run of small torch ops in a decoder layer with one
Triton launch, so a step captured in a CUDA graph holds fewer kernels per layer.

    add_rms_norm(x_TD, residual_TD | None, weight_D, eps, *, backend="auto") -> (out_TD, sum_TD)
        sum = x (+ residual, in x's dtype); out = RMSNorm(sum) as serve/model/layers.py's RMSNorm.
        Replaces the residual add and RMSNorm's ~8 ops (input_layernorm with the previous layer's MLP
        output as the residual partner, post_attention_layernorm with the attention output). x may also
        be a MoE layer's float32 per-pair rows [T, K, D] (kernels.moe.moe_forward(..., reduce=False)):
        their sum over K, rounded to the residual's dtype, is then x (the MoE's own sum, in this launch).
    qk_norm_rope_cache(qkv_TN, q_norm_w_C, k_norm_w_C, eps, cos_TC, sin_TC, k_cache, v_cache,
                       slot_mapping_T, num_heads, *, backend="auto") -> q_THC
        What Attention.forward does between the fused q/k/v projection and attention (the GPU twin of
        kernels/csrc/attention_prologue_cpu.cpp): qkv [T, (H + 2G) * C] = [q | k | v] columns; q and k
        heads RMSNorm'd over C with their weights and rotated (apply_rope, rotate-half) by cos/sin [T, C];
        k and v written to k_cache / v_cache [num_slots, G, C] at row slot_mapping_T[t], in the caches'
        dtype. Returns q [T, H, C] in qkv's dtype.
    router_topk(logits_TE, top_k, renormalize, *, record=None, backend="auto") -> (weights_TK, ids_TK)
        SparseMoE.forward's routing: softmax in acc_dtype, top-k, optional renormalisation, weights in
        the logits' dtype, ids int64. `record` = (routes_SMK, slots_T, m): also store the ids at each
        token's cache slot, MoE layer m (routing replay), in the routes' dtype, in the same launch.

`backend`: "auto" runs the Triton kernel on CUDA tensors, and on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1), else the torch reference; "triton" / "torch" force one (kernels/backend.py).

The references (`*_reference`) are the model's own arithmetic op for op (they are the CPU path and what
the kernels are tested against); the kernels round to the model dtype wherever the eager ops do, so they
differ from the references only by summation order in their reductions (and on a GPU by its approximate
exp and rsqrt): float32 within ~1e-6 relative, bfloat16 within one ulp of the model dtype, most values
bit-identical (kernels/fused_triton.py). Both paths have static output shapes and never synchronise with
the host, and each kernel is a single launch on a grid that depends on shapes only, so a step using them
can be captured in a CUDA graph.

Limits: argument checks look at shapes and dtypes only (no data: that would synchronise), so an
out-of-range slot is not reported; the kernel skips it, the reference's index_copy_ raises. Supported
dtypes: float16, bfloat16, float32, float64; norm weights in the input's dtype or float32; cos/sin in
qkv's dtype. The ops run under inference only (no autograd through the kernels).
"""

from __future__ import annotations

import torch

from kernels.backend import Backend, use_triton
from kernels.moe_reference import acc_dtype

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# ---------------------------------------------------------------- torch references


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, acc: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm as the model computes it (serve/model/layers.py RMSNorm.forward calls this): the mean
    square in acc_dtype (or `acc`: float64 in the batch-invariant mode), the normed x rounded to x's
    dtype, then times the weight."""
    dtype = x.dtype
    x32 = x.to(acc or acc_dtype(dtype))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def apply_rope(x_TNC: torch.Tensor, cos_TC: torch.Tensor, sin_TC: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half, in x's dtype: the model's (serve/model/layers.py uses this one)."""
    half = x_TNC.shape[-1] // 2
    rotated = torch.cat([-x_TNC[..., half:], x_TNC[..., :half]], dim=-1)
    return x_TNC * cos_TC[:, None, :] + rotated * sin_TC[:, None, :]


def add_rms_norm_reference(x_TD: torch.Tensor, residual_TD: torch.Tensor | None, weight_D: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x_TD.dim() == 3:  # a MoE layer's per-pair rows: its output as the MoE path sums them
        x_TD = x_TD.sum(dim=1).to(residual_TD.dtype)
    sum_TD = x_TD if residual_TD is None else x_TD + residual_TD
    return rms_norm(sum_TD, weight_D, eps), sum_TD


def qk_norm_rope_cache_reference(qkv_TN: torch.Tensor, q_norm_w_C: torch.Tensor, k_norm_w_C: torch.Tensor,
                                 eps: float, cos_TC: torch.Tensor, sin_TC: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, slot_mapping_T: torch.Tensor,
                                 num_heads: int) -> torch.Tensor:
    T, C, H = qkv_TN.shape[0], q_norm_w_C.shape[0], num_heads
    G = (qkv_TN.shape[1] // C - H) // 2
    dtype = qkv_TN.dtype
    q_TN, k_TN, v_TN = qkv_TN.split([H * C, G * C, G * C], dim=-1)
    # `.to(dtype)`: a no-op for weights in the model dtype (as the model holds them); float32 weights
    # (as the CPU prologue takes them) then give the same values, since their product rounds once either way.
    q_THC = rms_norm(q_TN.reshape(T, H, C), q_norm_w_C, eps).to(dtype)
    k_TGC = rms_norm(k_TN.reshape(T, G, C), k_norm_w_C, eps).to(dtype)
    v_TGC = v_TN.reshape(T, G, C)
    q_THC, k_TGC = apply_rope(q_THC, cos_TC, sin_TC), apply_rope(k_TGC, cos_TC, sin_TC)
    k_cache.index_copy_(0, slot_mapping_T, k_TGC.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping_T, v_TGC.to(v_cache.dtype))
    return q_THC


def router_topk_reference(logits_TE: torch.Tensor, top_k: int, renormalize: bool,
                          record: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=acc_dtype(logits_TE.dtype))
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if record is not None:
        routes_SMK, slots_T, m = record
        routes_SMK[slots_T.long(), m] = ids_TK.to(routes_SMK.dtype)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype), ids_TK


# ---------------------------------------------------------------- checks


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, not {t.dtype}")


def _check_weight(name: str, w: torch.Tensor, size: int, dtype: torch.dtype) -> None:
    if w.shape != (size,):
        raise ValueError(f"{name} must be [{size}], not {list(w.shape)}")
    if w.dtype not in (dtype, torch.float32):
        raise TypeError(f"{name} must be {dtype} or float32, not {w.dtype}")


# ---------------------------------------------------------------- public entries


def add_rms_norm(x_TD: torch.Tensor, residual_TD: torch.Tensor | None, weight_D: torch.Tensor, eps: float, *,
                 backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(sum) * weight, sum) with sum = x + residual (or x itself when residual is None, returned
    as is). out is in promote(weight, x) dtype, like RMSNorm's `weight * x`; sum in x's. x may be float32
    per-pair rows [T, K, D] of a MoE layer (with a residual): x is then their sum over K in the residual's
    dtype."""
    if x_TD.dim() == 3:
        if residual_TD is None or x_TD.dtype != torch.float32 or residual_TD.dim() != 2 \
                or residual_TD.shape != (x_TD.shape[0], x_TD.shape[2]):
            raise ValueError(f"per-pair rows x [T, K, D] must be float32 with a residual [T, D]; got x "
                             f"{list(x_TD.shape)} {x_TD.dtype}, residual "
                             f"{None if residual_TD is None else list(residual_TD.shape)}")
        _check_float("residual_TD", residual_TD)
        _check_weight("weight_D", weight_D, x_TD.shape[2], residual_TD.dtype)
    else:
        if x_TD.dim() != 2:
            raise ValueError(f"x_TD must be [T, D] (or per-pair rows [T, K, D]), not {list(x_TD.shape)}")
        _check_float("x_TD", x_TD)
        if residual_TD is not None and (residual_TD.shape != x_TD.shape or residual_TD.dtype != x_TD.dtype):
            raise ValueError(f"residual_TD must match x_TD ({list(x_TD.shape)} {x_TD.dtype}), not "
                             f"{list(residual_TD.shape)} {residual_TD.dtype}")
        _check_weight("weight_D", weight_D, x_TD.shape[1], x_TD.dtype)
    if use_triton(x_TD.device, backend):
        from kernels.fused_triton import add_rms_norm_triton

        return add_rms_norm_triton(x_TD, residual_TD, weight_D, eps)
    return add_rms_norm_reference(x_TD, residual_TD, weight_D, eps)


def qk_norm_rope_cache(qkv_TN: torch.Tensor, q_norm_w_C: torch.Tensor, k_norm_w_C: torch.Tensor, eps: float,
                       cos_TC: torch.Tensor, sin_TC: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping_T: torch.Tensor, num_heads: int, *, backend: Backend = "auto") -> torch.Tensor:
    """q [T, H, C]: normed and rotated; k (normed, rotated) and v written into the caches at the slots."""
    if qkv_TN.dim() != 2:
        raise ValueError(f"qkv_TN must be [T, (H + 2G) * C], not {list(qkv_TN.shape)}")
    _check_float("qkv_TN", qkv_TN)
    T, N = qkv_TN.shape
    C, H = q_norm_w_C.shape[0], num_heads
    if C % 2 or N % C or (N // C - H) % 2 or N // C <= H:
        raise ValueError(f"qkv_TN width {N} is not (H + 2G) * C for H={H}, C={C} (C even, G >= 1)")
    G = (N // C - H) // 2
    _check_weight("q_norm_w_C", q_norm_w_C, C, qkv_TN.dtype)
    _check_weight("k_norm_w_C", k_norm_w_C, C, qkv_TN.dtype)
    if k_norm_w_C.dtype != q_norm_w_C.dtype:
        raise TypeError(f"q_norm_w_C and k_norm_w_C must share a dtype ({q_norm_w_C.dtype}, {k_norm_w_C.dtype})")
    for name, cs in (("cos_TC", cos_TC), ("sin_TC", sin_TC)):
        if cs.shape != (T, C) or cs.dtype != qkv_TN.dtype:
            raise ValueError(f"{name} must be [{T}, {C}] {qkv_TN.dtype}, not {list(cs.shape)} {cs.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or cache.shape[1:] != (G, C):
            raise ValueError(f"{name} must be [num_slots, {G}, {C}], not {list(cache.shape)}")
        _check_float(name, cache)
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension (it is written in place)")
    if slot_mapping_T.shape != (T,) or slot_mapping_T.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping_T must be [{T}] int32/int64, not {list(slot_mapping_T.shape)} "
                         f"{slot_mapping_T.dtype}")
    if use_triton(qkv_TN.device, backend):
        from kernels.fused_triton import qk_norm_rope_cache_triton

        return qk_norm_rope_cache_triton(qkv_TN, q_norm_w_C, k_norm_w_C, eps, cos_TC, sin_TC, k_cache, v_cache,
                                         slot_mapping_T, num_heads)
    return qk_norm_rope_cache_reference(qkv_TN, q_norm_w_C, k_norm_w_C, eps, cos_TC, sin_TC, k_cache, v_cache,
                                        slot_mapping_T.long(), num_heads)


def router_topk(logits_TE: torch.Tensor, top_k: int, renormalize: bool, *,
                record: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] in the logits' dtype, ids [T, K] int64) of each row's top_k softmax probabilities,
    largest first; `renormalize` divides the weights by their sum (Qwen3's norm_topk_prob). `record` =
    (routes_SMK [S, M, top_k] integer, slots_T [T] int32/int64, m): routes_SMK[slots_T, m] = ids as well
    (the kernel skips slots outside [0, S); the reference raises for them)."""
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE must be [T, E], not {list(logits_TE.shape)}")
    _check_float("logits_TE", logits_TE)
    if not 1 <= top_k <= logits_TE.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits_TE.shape[1]}], not {top_k}")
    if record is not None:
        routes_SMK, slots_T, m = record
        if routes_SMK.dim() != 3 or routes_SMK.shape[2] != top_k or routes_SMK.is_floating_point() \
                or routes_SMK.stride(2) != 1 or not 0 <= m < routes_SMK.shape[1]:
            raise ValueError(f"record's routes must be [S, M, {top_k}] integer with unit stride in K and m in "
                             f"[0, M), not {list(routes_SMK.shape)} {routes_SMK.dtype} with m={m}")
        if slots_T.shape != (logits_TE.shape[0],) or slots_T.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"record's slots must be [{logits_TE.shape[0]}] int32/int64, not "
                             f"{list(slots_T.shape)} {slots_T.dtype}")
    if use_triton(logits_TE.device, backend):
        from kernels.fused_triton import router_topk_triton

        return router_topk_triton(logits_TE, top_k, renormalize, record)
    return router_topk_reference(logits_TE, top_k, renormalize, record)
