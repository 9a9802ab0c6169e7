"""The MoE seam: the one function the model (serve/model, train) calls for a Qwen3-MoE expert layer.

    moe_forward(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, *, backend="auto", mma="auto",
                cpu_packed=None) -> out_TD

    T tokens, D hidden size, K experts per token, E experts, I expert intermediate size.
    x_TD            [T, D]      bf16 (fp16/fp32 accepted) hidden states
    topk_ids_TK     [T, K]      int, expert of each token's k-th choice, in [0, E), distinct per token
    topk_weights_TK [T, K]      float, router weights as the model wants them (Qwen3: softmax over the
                                top-k logits when norm_topk_prob, else the top-k of the full softmax)
    w13             [E, 2I, D]  gate_up_proj: rows [gate; up] (Qwen3-MoE / HF `gate_up_proj` layout)
    w2              [E, D, I]   down_proj
    returns         [T, D]      in x's dtype: sum_k w[t,k] * w2[e] @ (silu(gate_e x_t) * up_e x_t)

w13 and w2 are both plain tensors (bf16/fp32: the grouped torch reference runs, differentiable, for
parity checks and bf16 baselines) or both `MXFP8Tensor` (data [E, N, Kred] float8_e4m3fn + scales
[E, N, Kred // 32] E8M0, from `MXFP8Tensor.quantize(w)`): the fused Triton kernels run on a GPU, or under
the interpreter on the CPU when TRITON_INTERPRET=1; otherwise (CPU serving) the reference runs on the
dequantized weights. The kernel path does not build an autograd graph; for training in the served
precision use `kernels.mxfp8_linear.mxfp8_moe` (same forward, gradients to master weights).

`backend` forces "triton" or "torch"; `mma` picks the kernel's matrix multiply ("dequant" for sm_90,
"dot_scaled" for sm_100+, "auto" by device); see kernels/moe_triton.py. `cpu_packed` (CPU inference
with plain weights) is `kernels.moe_reference.pack_experts(w13, w2)`, used by small batches.
"""

from __future__ import annotations

import torch

from kernels.backend import Backend, use_triton
from kernels.moe_reference import moe_all_experts, moe_few_tokens, moe_reference
from kernels.mxfp8 import MXFP8Tensor

# Up to this many tokens, CPU inference skips the grouped reference: a batch that touches most experts runs
# them all at once (moe_all_experts), one that touches few groups its tokens in Python (moe_few_tokens).
SMALL_BATCH = 64


def moe_forward(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                w13: torch.Tensor | MXFP8Tensor, w2: torch.Tensor | MXFP8Tensor, *,
                backend: Backend = "auto", mma: str = "auto", cpu_packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    _check(x_TD, topk_ids_TK, topk_weights_TK, w13, w2)
    if isinstance(w13, MXFP8Tensor):
        if use_triton(x_TD.device, backend):
            from kernels.moe_triton import fused_moe_mxfp8
            return fused_moe_mxfp8(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, mma=mma)
        return moe_reference(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, act_mxfp8=mma == "dot_scaled")
    if backend == "triton":
        raise ValueError("the Triton MoE path takes MXFP8 weights: pass MXFP8Tensor.quantize(w)")
    T, K = topk_ids_TK.shape
    if x_TD.device.type == "cpu" and T <= SMALL_BATCH and not torch.is_grad_enabled():
        if T * K >= w13.shape[0]:
            return moe_all_experts(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, cpu_packed)
        return moe_few_tokens(x_TD, topk_ids_TK, topk_weights_TK, w13, w2)
    return moe_reference(x_TD, topk_ids_TK, topk_weights_TK, w13, w2)


def _check(x_TD, topk_ids_TK, topk_weights_TK, w13, w2) -> None:
    if type(w13) is not type(w2) or not isinstance(w13, (torch.Tensor, MXFP8Tensor)):
        raise TypeError("w13 and w2 must both be tensors or both be MXFP8Tensor")
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD must be [T, D], got {tuple(x_TD.shape)}")
    T, D = x_TD.shape
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T or topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"topk ids {tuple(topk_ids_TK.shape)} and weights {tuple(topk_weights_TK.shape)} "
                         f"must both be [T={T}, K]")
    if topk_ids_TK.dtype.is_floating_point:
        raise TypeError(f"topk_ids_TK must be integer, not {topk_ids_TK.dtype}")
    if len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError("w13 must be [E, 2I, D] and w2 [E, D, I]")
    E, two_i, d13 = w13.shape
    if d13 != D or two_i % 2 or tuple(w2.shape) != (E, D, two_i // 2):
        raise ValueError(f"with x [T, {D}]: w13 {tuple(w13.shape)} must be [E, 2I, {D}] and w2 "
                         f"{tuple(w2.shape)} must be [E, {D}, I]")
    for t in (topk_ids_TK, topk_weights_TK, w13.data if isinstance(w13, MXFP8Tensor) else w13,
              w2.data if isinstance(w2, MXFP8Tensor) else w2):
        if t.device != x_TD.device:
            raise ValueError(f"all inputs must be on {x_TD.device}, found one on {t.device}")
