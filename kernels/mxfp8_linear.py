"""Training in the precision that is served: MXFP8 forward, gradients to high-precision master weights.

Approach: straight-through estimation. The forward pass uses exactly the weights the server will load,
`dequantize(quantize(w_master))` with the same quantizer (so the same bytes), and the backward pass
treats quantization as the identity: dL/dw_master = dL/dw_dequantized. The optimizer keeps updating
float32/bf16 masters; exporting them with `MXFP8Tensor.quantize` reproduces the trained forward exactly.

- `fake_quantize_mxfp8(w)`: the building block, differentiable (identity gradient).
- `mxfp8_linear(x, w, bias)` / `MXFP8Linear`: a linear layer that saves the fp8 bytes (1 + 1/32 bytes per
  weight) rather than a dequantized copy for its backward pass.
- `mxfp8_moe(x, ids, weights, w13, w2)`: the expert layer. Its forward is `moe_forward` on the
  quantized weights, i.e. the served kernel itself on a GPU; its backward is kernels/moe_grouped.py's
  grouped GEMMs over the pairs sorted by expert, on the dequantized weights (x, router weights, both
  expert tensors). With a `QuantCache` the masters are quantized once per optimizer step: the cache
  holds the MXFP8 copy while the masters' version counters (bumped by every in-place update, i.e. by
  the optimizer) are unchanged, so every micro-batch of a step reuses it.

Limits: the backward's matmuls are torch grouped GEMMs (bf16), not fused kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.backend import Backend
from kernels.moe import moe_forward
from kernels.moe_grouped import moe_backward
from kernels.mxfp8 import MXFP8Tensor, ScaleMode, dequantize_mxfp8, quantize_mxfp8


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scale_mode, backend):
        data, scales = quantize_mxfp8(w.detach(), scale_mode=scale_mode, backend=backend)
        return dequantize_mxfp8(data, scales, w.dtype, backend=backend)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quantize_mxfp8(w: torch.Tensor, scale_mode: ScaleMode = "rceil", backend: Backend = "auto"):
    """w -> dequantize(quantize(w)) in w's dtype; the gradient passes straight through."""
    return _FakeQuantize.apply(w, scale_mode, backend)


class _MXFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, scale_mode, backend):
        data, scales = quantize_mxfp8(w.detach(), scale_mode=scale_mode, backend=backend)
        w_q = dequantize_mxfp8(data, scales, x.dtype, backend=backend)
        ctx.save_for_backward(x, data, scales)
        ctx.w_dtype, ctx.has_bias, ctx.backend = w.dtype, bias is not None, backend
        return F.linear(x, w_q, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, data, scales = ctx.saved_tensors
        w_q = dequantize_mxfp8(data, scales, grad_out.dtype, backend=ctx.backend)
        grad_x = grad_out @ w_q if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        g_2d, x_2d = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = (g_2d.T @ x_2d.to(g_2d.dtype)).to(ctx.w_dtype)  # straight through the quantizer
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g_2d.sum(0)
        return grad_x, grad_w, grad_b, None, None


def mxfp8_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 scale_mode: ScaleMode = "rceil", backend: Backend = "auto") -> torch.Tensor:
    """y = x @ Q(w).T + bias with Q the MXFP8 round trip (blocks along w's input dim)."""
    return _MXFP8Linear.apply(x, w, bias, scale_mode, backend)


class MXFP8Linear(torch.nn.Linear):
    """nn.Linear whose forward uses the MXFP8-quantized weight; drop-in for training."""

    scale_mode: ScaleMode = "rceil"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mxfp8_linear(x, self.weight, self.bias, self.scale_mode)


class QuantCache:
    """The MXFP8 copy of a pair of master weights, valid while neither changes (same storage, same
    version counter). `quantizations` counts the real quantizations (tests and the benchmark read it)."""

    def __init__(self):
        self.key: tuple | None = None
        self.value: tuple[MXFP8Tensor, MXFP8Tensor] | None = None
        self.quantizations = 0

    def get(self, w13: torch.Tensor, w2: torch.Tensor, scale_mode: ScaleMode, backend: Backend):
        key = (w13.data_ptr(), w13._version, w2.data_ptr(), w2._version, scale_mode, w13.dtype, w2.dtype)
        if key != self.key or self.value is None:
            self.value = (MXFP8Tensor.quantize(w13.detach(), scale_mode, backend),
                          MXFP8Tensor.quantize(w2.detach(), scale_mode, backend))
            self.key = key
            self.quantizations += 1
        return self.value


def _quantized(w13: torch.Tensor, w2: torch.Tensor, scale_mode: ScaleMode, backend: Backend,
               cache: QuantCache | None) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    if cache is not None:
        return cache.get(w13, w2, scale_mode, backend)
    return MXFP8Tensor.quantize(w13.detach(), scale_mode, backend), MXFP8Tensor.quantize(w2.detach(), scale_mode, backend)


class _MXFP8MoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, w13, w2, scale_mode, backend, mma, cache):
        q13, q2 = _quantized(w13, w2, scale_mode, backend, cache)
        # the weights themselves, not their MXFP8 copy: the backward takes the copy from the cache, or
        # quantizes again (under FSDP the gathered weights are freed after the forward and gathered again
        # for the backward, so no layer's copy waits in memory for it)
        ctx.save_for_backward(x_TD, topk_ids_TK, topk_weights_TK, w13, w2)
        ctx.scale_mode, ctx.backend, ctx.cache = scale_mode, backend, cache
        return moe_forward(x_TD, topk_ids_TK, topk_weights_TK, q13, q2, backend=backend, mma=mma)

    @staticmethod
    def backward(ctx, grad_TD):
        x_TD, ids_TK, weights_TK, m13, m2 = ctx.saved_tensors
        q13, q2 = _quantized(m13, m2, ctx.scale_mode, ctx.backend, ctx.cache)
        w13 = q13.dequantize(x_TD.dtype, backend=ctx.backend)
        w2 = q2.dequantize(x_TD.dtype, backend=ctx.backend)
        g_x, g_w, g_13, g_2 = moe_backward(grad_TD.to(x_TD.dtype), x_TD, ids_TK, weights_TK, w13, w2)
        return (g_x, None, g_w.to(weights_TK.dtype), g_13.to(m13.dtype), g_2.to(m2.dtype), None, None, None, None)


def mxfp8_moe(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
              w13: torch.Tensor, w2: torch.Tensor, scale_mode: ScaleMode = "rceil",
              backend: Backend = "auto", mma: str = "auto", cache: QuantCache | None = None) -> torch.Tensor:
    """`moe_forward` with master weights w13 [E, 2I, D] and w2 [E, D, I] quantized on the fly (or taken
    from `cache` while the masters are unchanged); gradients flow to x, topk_weights and the masters
    (straight through the quantizer, and straight through the activation rounding when the sm_100 kernel
    quantizes activations)."""
    return _MXFP8MoE.apply(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, scale_mode, backend, mma, cache)
