"""Batch-invariant numerics: a token's results depend on its own inputs only, not on the rest of the batch.

Why: the default kernels (oneDNN/MKL/cuBLAS matmuls, SDPA's flash attention, torch's vectorised
reductions) sum in float32 in an order that depends on the shapes they are handed. One row of a
[1, D] x [D, N] product and the same row inside an [L, D] x [D, N] product can differ in the last
float32 bits, which is often enough one bfloat16 ulp, and a few layers later a log-prob moves by 1e-2.
So the server's decode step, its chunked prefill and the trainer's whole-sequence forward disagree
although they compute the same function.

Approach: in this mode every reduction (matmuls, attention, norms, softmax, the experts' weighted sum)
and every transcendental (exp, silu, rsqrt, cos/sin) runs in float64, and the result is rounded to the
model's dtype at the same points where the default path rounds. Products of bfloat16, float16 or float32
values are exact in float64 (8 + 8, 11 + 11, 24 + 24 significant bits <= 53), and their sums stay exact
over the ranges a model produces, so a sum does not depend on the order it was taken in. Where float64 does
round (exp, terms 2^53 times smaller than the sum), the results differ by ~2^-52 relative, which the final
rounding to the model's dtype erases except with probability ~1e-13 per value. One token's logits are then
the same bits alone or in any batch, in one prefill or in chunks or decoded step by step, and whether the
server or the trainer computes them: its log-probs are a function of the token ids (vLLM's and SGLang's
batch-invariant modes reach the same with fixed-order kernels; exactness is the CPU-friendly way there).

Cost: float64 matmuls (a few times slower than bfloat16 on a CPU, far slower on most GPUs), no fused or
packed kernels; bench/train_serve_gap.py measures it. Limits: a float64 model is not made invariant (there
is nothing wider to sum in); the elementwise ops that stay in the model's dtype (residual adds, rotary,
SwiGLU's product, the norm's weight) are correctly rounded and so already invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe_reference import moe_reference

WIDE = torch.float64


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b) summed exactly, rounded once to x's dtype (as a bf16 GEMM with float32 accumulation
    rounds its output)."""
    return F.linear(x.to(WIDE), w.to(WIDE), None if b is None else b.to(WIDE)).to(x.dtype)


def proj(m: torch.nn.Linear, x: torch.Tensor, exact: bool) -> torch.Tensor:
    """A linear layer's forward, exact or the module's own."""
    return linear(x, m.weight, m.bias) if exact else m(x)


def attention(q_BHQC: torch.Tensor, k_BGLC: torch.Tensor, v_BGLC: torch.Tensor,
              allowed_BQL: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(C)) v over the keys `allowed_BQL` lets each query see (bool, broadcast over
    heads), in float64, rounded once to q's dtype: [B, H, Q, C]. Grouped-query heads share their kv head."""
    dtype, H, G = q_BHQC.dtype, q_BHQC.shape[1], k_BGLC.shape[1]
    k, v = k_BGLC.to(WIDE), v_BGLC.to(WIDE)
    if H != G:
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    scores = (q_BHQC.to(WIDE) @ k.transpose(-1, -2)) * q_BHQC.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed_BQL[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(dtype)


def causal(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """[1, Q, L] True where query i (the last q_len of ctx_len positions) may see key j."""
    rows = torch.arange(q_len, device=device)[:, None] + (ctx_len - q_len)
    return (torch.arange(ctx_len, device=device)[None, :] <= rows)[None]


def moe(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, w13, w2) -> torch.Tensor:
    """The expert layer with exact sums: kernels/moe_reference.py's grouped reference in its `exact` mode
    (gate/up and down projections rounded to x's dtype as the default path rounds them, silu and the
    router-weighted sum in float64). Differentiable (training with plain or fake-quantized masters)."""
    return moe_reference(x_TD, ids_TK, weights_TK, w13, w2, exact=True)
