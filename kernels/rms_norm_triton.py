"""RMSNorm for training: the forward and the backward each one Triton launch (plus the weight gradient's sum).

`rms_norm_train(x, w, eps)` computes what kernels/fused.py's `rms_norm` computes (the model's RMSNorm):

    r = rsqrt(mean(x^2) + eps) in float32       n = (x * r) rounded to x's dtype       y = w * n in x's dtype

and differentiates it as autograd does through those torch ops (straight through the two roundings):

    dn = dy * w        dx = r * dn - x * r^3 * mean(dn * x)        dw = sum over rows of dy * n

In torch that is ~8 kernels forward and ~15 backward per norm (casts, pow, mean, rsqrt, products, the
weight gradient's reduction, each a pass over [rows, C] in float32); a Qwen3 layer has four norms (input,
post-attention, q and k heads). Here: one forward launch, one backward launch that writes dx and per-block
float32 partial sums of dw, and one sum of those. The forward saves x and r ([rows] float32), not the float32
copies autograd keeps.

Numerics: float32 inside, the same rounding points as the torch ops; only the mean's summation order differs
(as in kernels/fused_triton.py). Under the Triton interpreter bfloat16 is handed over as int16 bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import interpreting
from kernels.launches import launch
from kernels.mxfp8_triton import bf16_bits_to_float32, float32_to_bf16_bits, load_f32, store_f32


@triton.jit
def _round(v, like_ptr, BITS: tl.constexpr):
    """v rounded to like_ptr's element type, held in float32."""
    if BITS:
        return bf16_bits_to_float32(float32_to_bf16_bits(v))
    return v.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, r_ptr, N, C, eps,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < N
    mask = rmask[:, None] & (cols < C)[None, :]
    offs = rows[:, None] * C + cols[None, :]
    x = load_f32(x_ptr + offs, mask, BITS)
    w = load_f32(w_ptr + cols, cols < C, BITS)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / C + eps)
    n = _round(x * r[:, None], x_ptr, BITS)
    store_f32(y_ptr + offs, w[None, :] * n, mask, BITS)
    tl.store(r_ptr + rows, r, mask=rmask)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, r_ptr, dy_ptr, dx_ptr, dw_ptr, N, C,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < N
    mask = rmask[:, None] & (cols < C)[None, :]
    offs = rows[:, None] * C + cols[None, :]
    x = load_f32(x_ptr + offs, mask, BITS)
    dy = load_f32(dy_ptr + offs, mask, BITS)
    w = load_f32(w_ptr + cols, cols < C, BITS)
    r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
    n = _round(x * r[:, None], x_ptr, BITS)
    dn = _round(dy * w[None, :], x_ptr, BITS)  # autograd's product in x's dtype
    dot = tl.sum(dn * x, axis=1)
    dx = r[:, None] * dn - x * (r * r * r * dot / C)[:, None]
    store_f32(dx_ptr + offs, dx, mask, BITS)
    tl.store(dw_ptr + pid * C + cols, tl.sum(dy * n, axis=0), mask=cols < C)


def _bits(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if interpreting() and t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    return t, False


def _blocks(C: int) -> tuple[int, int, int]:
    block_c = triton.next_power_of_2(C)
    block_r = max(1, min(64, 4096 // block_c))
    return block_r, block_c, 4 if block_r * block_c <= 4096 else 8


class _RMSNormTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        C = x.shape[-1]
        x2 = x.reshape(-1, C).contiguous()
        N = x2.shape[0]
        y = torch.empty_like(x2)
        r = torch.empty(N, dtype=torch.float32, device=x.device)
        w_k = w.contiguous()
        block_r, block_c, warps = _blocks(C)
        if N:
            (x_k, bits), (wk, _), (y_k, _) = _bits(x2), _bits(w_k), _bits(y)
            with launch("rms_norm_fwd"):
                _rms_norm_fwd_kernel[(triton.cdiv(N, block_r),)](x_k, wk, y_k, r, N, C, eps, BLOCK_R=block_r,
                                                                 BLOCK_C=block_c, BITS=bits, num_warps=warps)
        ctx.save_for_backward(x2, w_k, r)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, r = ctx.saved_tensors
        N, C = x2.shape
        dy2 = dy.reshape(-1, C).to(x2.dtype).contiguous()
        dx = torch.empty_like(x2)
        block_r, block_c, warps = _blocks(C)
        grid = triton.cdiv(N, block_r)
        dw_part = torch.zeros(max(grid, 1), C, dtype=torch.float32, device=x2.device)
        if N:
            (x_k, bits), (w_k, _), (dy_k, _), (dx_k, _) = _bits(x2), _bits(w), _bits(dy2), _bits(dx)
            with launch("rms_norm_bwd"):
                _rms_norm_bwd_kernel[(grid,)](x_k, w_k, r, dy_k, dx_k, dw_part, N, C, BLOCK_R=block_r,
                                              BLOCK_C=block_c, BITS=bits, num_warps=warps)
        dw = dw_part.sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), dw, None


def rms_norm_train(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.fused.rms_norm with a one-launch forward and backward (see the module docstring); x and w in
    one of bfloat16, float16, float32 (x's dtype = w's: the trainer's compute dtype)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.dtype != x.dtype or w.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_train: x {x.dtype} {tuple(x.shape)} and weight {w.dtype} {tuple(w.shape)}: "
                         f"one dtype of bf16/fp16/fp32, weight [C] for x [..., C]")
    return _RMSNormTrain.apply(x, w, eps)
