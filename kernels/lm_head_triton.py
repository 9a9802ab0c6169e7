"""kernels/lm_head.py's sliced LM-head log-probs with each slice's softmax work in one Triton launch.

`fused_chunked_logprobs(h, W, targets, chunk)` = `chunked_logprobs(...)`: log_softmax(h @ W.T)[n, targets[n]]
walking the vocabulary `chunk` rows of W at a time. Per slice the torch version runs the matmul and then ~20
elementwise kernels over the [N, chunk] logits in float32 (the cast, max, exp, sums, the target's pick, masks)
forward, and ~15 backward; at Qwen3's 151,936 rows (10 slices of 16,384) and 4,096 scored tokens that is ~2 GB
of float32 traffic per slice each way. Here the matmul stays cuBLAS's, and one launch per slice reads the
slice's logits once in their dtype:

- forward (`_slice_stats_kernel`): per row the slice's max and sum of exp, merged into a running max/sum
  (online log-sum-exp), and the target's logit if the slice holds it, in place;
- backward (`_slice_grad_kernel`): d logit = g * (onehot(target) - exp(z - lse)), rounded to the weights' dtype as
  the torch version does, then the two matmuls (dz @ W_slice added to dh in float32, dz.T @ h into dW's rows).

Numerics: the logits are the matmul's in the weights' dtype, widened to float32, as in kernels/lm_head.py; the
sums run in another order (float32 rounding). Under the Triton interpreter bfloat16 is handed over as int16 bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.backend import interpreting
from kernels.launches import launch
from kernels.mxfp8_triton import float32_to_bf16_bits, load_f32


@triton.jit
def _slice_stats_kernel(z_ptr, tgt_ptr, max_ptr, sum_ptr, picked_ptr, V, start, stride_z,
                        BLOCK_V: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), -3.0e38, tl.float32)  # finite: lanes past the slice's end stay here, no inf - inf
    s = tl.zeros((BLOCK_V,), tl.float32)
    tgt = tl.load(tgt_ptr + row) - start
    pick = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        mask = c < V
        z = tl.where(mask, load_f32(z_ptr + row * stride_z + c, mask, BITS), -3.0e38)
        new_m = tl.maximum(m, z)
        s = s * tl.exp(m - new_m) + tl.where(mask, tl.exp(z - new_m), 0.0)
        m = new_m
        pick += tl.where(c == tgt, z, 0.0)
    row_max = tl.max(m, axis=0)
    row_sum = tl.sum(s * tl.exp(m - row_max), axis=0)
    old_m = tl.load(max_ptr + row)
    old_s = tl.load(sum_ptr + row)
    new_max = tl.maximum(old_m, row_max)
    tl.store(sum_ptr + row, old_s * tl.exp(old_m - new_max) + row_sum * tl.exp(row_max - new_max))
    tl.store(max_ptr + row, new_max)
    inside = (tgt >= 0) & (tgt < V)
    tl.store(picked_ptr + row, tl.where(inside, tl.sum(pick, axis=0), tl.load(picked_ptr + row)))


@triton.jit
def _slice_grad_kernel(z_ptr, tgt_ptr, lse_ptr, g_ptr, dz_ptr, V, start, stride_z, stride_dz,
                       BLOCK_V: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    tgt = tl.load(tgt_ptr + row) - start
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        mask = c < V
        z = load_f32(z_ptr + row * stride_z + c, mask, BITS)
        dz = tl.where(c == tgt, g, 0.0) - g * tl.exp(z - lse)
        if BITS:
            tl.store(dz_ptr + row * stride_dz + c, float32_to_bf16_bits(dz), mask=mask)
        else:
            tl.store(dz_ptr + row * stride_dz + c, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def _bits(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if interpreting() and t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    return t, False


BLOCK_V = 1024


class _FusedChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, chunk):
        N, V = h_ND.shape[0], w_VD.shape[0]
        run_max = torch.full((N,), float("-inf"), device=h_ND.device)
        run_sum = torch.zeros(N, device=h_ND.device)
        picked = torch.zeros(N, device=h_ND.device)
        targets_N = targets_N.contiguous()
        for start in range(0, V, chunk):
            z_NC = F.linear(h_ND, w_VD[start:start + chunk])
            if N:
                z_k, bits = _bits(z_NC)
                with launch("lm_head_slice_stats"):
                    _slice_stats_kernel[(N,)](z_k, targets_N, run_max, run_sum, picked, z_NC.shape[1], start,
                                              z_NC.stride(0), BLOCK_V=BLOCK_V, BITS=bits, num_warps=4)
        lse_N = run_max + torch.log(run_sum)
        ctx.save_for_backward(h_ND, w_VD, targets_N, lse_N)
        ctx.chunk = chunk
        return picked - lse_N

    @staticmethod
    def backward(ctx, g_N):
        h_ND, w_VD, targets_N, lse_N = ctx.saved_tensors
        g_N = g_N.float().contiguous()
        N = h_ND.shape[0]
        g_h = torch.zeros(h_ND.shape, dtype=torch.float32, device=h_ND.device)
        g_w = torch.empty_like(w_VD) if ctx.needs_input_grad[1] else None
        for start in range(0, w_VD.shape[0], ctx.chunk):
            w_CD = w_VD[start:start + ctx.chunk]
            z_NC = F.linear(h_ND, w_CD)
            dz_NC = torch.empty_like(z_NC)
            if N:
                (z_k, bits), (dz_k, _) = _bits(z_NC), _bits(dz_NC)
                with launch("lm_head_slice_grad"):
                    _slice_grad_kernel[(N,)](z_k, targets_N, lse_N, g_N, dz_k, z_NC.shape[1], start, z_NC.stride(0),
                                             dz_NC.stride(0), BLOCK_V=BLOCK_V, BITS=bits, num_warps=4)
            g_h += (dz_NC @ w_CD).float()
            if g_w is not None:
                torch.mm(dz_NC.t(), h_ND, out=g_w[start:start + ctx.chunk])
        return g_h.to(h_ND.dtype), g_w, None, None


def fused_chunked_logprobs(h_ND: torch.Tensor, w_VD: torch.Tensor, targets_N: torch.Tensor, chunk: int) -> torch.Tensor:
    """float32 [N]: log_softmax(h @ w.T)[n, targets[n]], `chunk` vocabulary rows at a time, each slice's softmax
    work in one launch (see the module docstring). h and w in one floating dtype, bf16/fp16/fp32."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if h_ND.dtype != w_VD.dtype or h_ND.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused_chunked_logprobs takes h and w in one of bf16/fp16/fp32, not {h_ND.dtype}/{w_VD.dtype}")
    return _FusedChunkedLogprobs.apply(h_ND, w_VD, targets_N, chunk)
