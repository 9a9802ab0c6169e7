"""Torch references of kernels/batch_invariant_triton.py: the same functions with torch's own kernels.

They compute what the kernels compute (float32 sums, the same rounding points), only not in a fixed order,
so they agree with the kernels to float32 rounding, not bit for bit. Two uses: the kernels' tests check
values against them, and serve/model/numerics.py differentiates through them (the trainer's backward:
only its forward must match the server's bits). Torch only: no triton import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe_reference import moe_reference


def matmul(x: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    out = x.float() @ w_NK.float().T
    if bias_N is not None:
        out = out + bias_N.float()
    return out.to(out_dtype or x.dtype)


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight_D * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g.float()).to(g.dtype) * u


def weighted_sum(y_TKD: torch.Tensor, weights_TK: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return (y_TKD.float() * weights_TK.float()[..., None]).sum(1).to(out_dtype or weights_TK.dtype)


def moe(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, w13, w2) -> torch.Tensor:
    """kernels/moe_reference.py's grouped path (float32 sums, the same rounding points): differentiable in
    x, the router weights and plain w13/w2, without per-pair weight copies."""
    return moe_reference(x_TD, ids_TK, weights_TK, w13, w2)


def attention(q_BQHC: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens_BQ: torch.Tensor,
              tables_BN: torch.Tensor | None = None, page: int = 0) -> torch.Tensor:
    """The kernel's contract in torch: query (b, i) sees keys 0..lens[b, i]-1 of sequence b."""
    B, Q, H, C = q_BQHC.shape
    if tables_BN is not None:  # gather the paged cache into dense [B, G, L, C]
        j = torch.arange(tables_BN.shape[1] * page, device=k.device)
        slots_BL = tables_BN.long()[:, j // page] * page + j % page
        k, v = (c[slots_BL].permute(0, 2, 1, 3) for c in (k, v))
    G, L = k.shape[1], k.shape[2]
    k, v = k.float(), v.float()
    if H != G:
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    scores = torch.einsum("bqhc,bhlc->bhql", q_BQHC.float(), k) * C ** -0.5
    visible = torch.arange(L, device=k.device) < lens_BQ.long()[..., None]  # [B, Q, L]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhql,bhlc->bqhc", torch.softmax(scores, -1), v).to(q_BQHC.dtype)
