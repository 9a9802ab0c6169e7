"""The MoE expert layer's SwiGLU backward, with the router weight and its gradient, in one launch.

For pairs sorted by expert (kernels/moe_grouped.py), with gate_up = x @ w13[e].T recomputed and
ghu = grad[t] @ w2[e] (the gradient of h = silu(gate) * up before the router weight w scales it), one
program per pair row computes in float32 from the bf16 inputs, rounding each output once:

    dgate = w * ghu * up * silu'(gate)     dup = w * ghu * silu(gate)      -> dgu [P, 2I]
    hw    = w * silu(gate) * up                                            -> hw  [P, I]   (g_w2 = grad[t].T @ hw)
    g_w   = sum_i ghu * silu(gate) * up                                    -> g_w [P]      (float32)

It replaces ~14 elementwise passes of the torch backward (sigmoid, silu, products and the float32
copies of the [P, D] gradient rows that weighted them) and one grouped GEMM (y = h @ w2.T, recomputed only
for g_w = <grad, y>: here g_w = <grad @ w2, h>, the same sum in another order).
`kernels.moe_grouped.swiglu_backward_reference` is the same arithmetic in torch (the CPU path and the test's
reference).

Under the Triton interpreter bfloat16 tensors are handed over as int16 bits (kernels/fused_triton.py's rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import interpreting
from kernels.launches import launch
from kernels.mxfp8_triton import load_f32, store_f32


@triton.jit
def _swiglu_backward_kernel(gu_ptr, ghu_ptr, w_ptr, dgu_ptr, hw_ptr, gw_ptr, inter,
                            stride_gu, stride_ghu, stride_dgu, stride_hw,
                            BLOCK_I: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_I)
    mask = cols < inter
    gate = load_f32(gu_ptr + row * stride_gu + cols, mask, BITS)
    up = load_f32(gu_ptr + row * stride_gu + inter + cols, mask, BITS)
    ghu = load_f32(ghu_ptr + row * stride_ghu + cols, mask, BITS)
    w = tl.load(w_ptr + row).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    h = silu * up
    gh = ghu * w
    dgate = gh * up * (sig * (1.0 + gate * (1.0 - sig)))
    dup = gh * silu
    store_f32(dgu_ptr + row * stride_dgu + cols, dgate, mask, BITS)
    store_f32(dgu_ptr + row * stride_dgu + inter + cols, dup, mask, BITS)
    store_f32(hw_ptr + row * stride_hw + cols, h * w, mask, BITS)
    tl.store(gw_ptr + row, tl.sum(tl.where(mask, ghu * h, 0.0), axis=0))


def _bits(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if interpreting() and t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    return t, False


def swiglu_backward_triton(gate_up_PI2: torch.Tensor, ghu_PI: torch.Tensor, weight_P: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgu [P, 2I], hw [P, I] in gate_up's dtype, g_w [P] float32): see the module docstring."""
    P, I2 = gate_up_PI2.shape
    inter = I2 // 2
    if ghu_PI.shape != (P, inter) or weight_P.shape != (P,) or I2 % 2:
        raise ValueError(f"swiglu_backward: gate_up {tuple(gate_up_PI2.shape)}, ghu {tuple(ghu_PI.shape)} and "
                         f"weight {tuple(weight_P.shape)} do not fit ([P, 2I], [P, I], [P])")
    if gate_up_PI2.dtype not in (torch.bfloat16, torch.float16, torch.float32) or ghu_PI.dtype != gate_up_PI2.dtype:
        raise ValueError(f"swiglu_backward takes bf16/fp16/fp32 inputs of one dtype, not {gate_up_PI2.dtype} "
                         f"and {ghu_PI.dtype}")
    gate_up_PI2 = gate_up_PI2 if gate_up_PI2.stride(-1) == 1 else gate_up_PI2.contiguous()
    ghu_PI = ghu_PI if ghu_PI.stride(-1) == 1 else ghu_PI.contiguous()
    weight_P = weight_P.float().contiguous()
    dgu = torch.empty_like(gate_up_PI2)
    hw = torch.empty(P, inter, dtype=gate_up_PI2.dtype, device=gate_up_PI2.device)
    gw = torch.empty(P, dtype=torch.float32, device=gate_up_PI2.device)
    if P == 0:
        return dgu, hw, gw
    (gu_k, bits), (ghu_k, _), (dgu_k, _), (hw_k, _) = _bits(gate_up_PI2), _bits(ghu_PI), _bits(dgu), _bits(hw)
    block = triton.next_power_of_2(inter)
    with launch("swiglu_backward"):
        _swiglu_backward_kernel[(P,)](gu_k, ghu_k, weight_P, dgu_k, hw_k, gw, inter,
                                      gate_up_PI2.stride(0), ghu_PI.stride(0), dgu.stride(0), hw.stride(0),
                                      BLOCK_I=block, BITS=bits, num_warps=4 if block <= 1024 else 8)
    return dgu, hw, gw
