"""The LM head and the log-prob of each target token, in vocabulary slices.

`chunked_logprobs(h, W, targets, chunk)` = log_softmax(h @ W.T)[n, targets[n]] without ever holding the
[N, V] logits: the forward walks the vocabulary `chunk` rows of W at a time, keeping a running max and
sum of exponentials per row (online log-sum-exp) and picking each target's logit from the slice that has
it; the backward walks the slices again, recomputing each slice's logits to get its softmax, so its
gradients (d logit = g * (onehot - softmax)) are formed and used one slice at a time. Memory beyond the
inputs is O(N x chunk) whatever the vocabulary (151,936 for Qwen3): at N = 8,192 trained tokens the
full-vocabulary float32 logits, their log-softmax and its gradient would be 5 GB each.

Each slice's logits are computed as the LM head computes them (a matmul in the weights' dtype, then
float32), so the log-probs are the full computation's up to float32 rounding of the sum order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, chunk):
        N, V = h_ND.shape[0], w_VD.shape[0]
        run_max = torch.full((N,), float("-inf"), device=h_ND.device)
        run_sum = torch.zeros(N, device=h_ND.device)
        picked = torch.zeros(N, device=h_ND.device)
        for start in range(0, V, chunk):
            z_NC = F.linear(h_ND, w_VD[start:start + chunk]).float()
            new_max = torch.maximum(run_max, z_NC.amax(1))
            run_sum = run_sum * torch.exp(run_max - new_max) + torch.exp(z_NC - new_max[:, None]).sum(1)
            run_max = new_max
            inside = (targets_N >= start) & (targets_N < start + z_NC.shape[1])
            col = (targets_N - start).clamp(0, z_NC.shape[1] - 1)
            picked = torch.where(inside, z_NC.gather(1, col[:, None]).squeeze(1), picked)
        lse_N = run_max + torch.log(run_sum)
        ctx.save_for_backward(h_ND, w_VD, targets_N, lse_N)
        ctx.chunk = chunk
        return picked - lse_N

    @staticmethod
    def backward(ctx, g_N):
        h_ND, w_VD, targets_N, lse_N = ctx.saved_tensors
        chunk = ctx.chunk
        g_N = g_N.float()
        g_h = torch.zeros(h_ND.shape, dtype=torch.float32, device=h_ND.device)
        g_w = torch.empty_like(w_VD) if ctx.needs_input_grad[1] else None
        rows = torch.arange(h_ND.shape[0], device=h_ND.device)
        for start in range(0, w_VD.shape[0], chunk):
            w_CD = w_VD[start:start + chunk]
            z_NC = F.linear(h_ND, w_CD).float()
            dz_NC = torch.exp(z_NC - lse_N[:, None]).mul_(-g_N[:, None])
            inside = (targets_N >= start) & (targets_N < start + z_NC.shape[1])
            col = (targets_N - start).clamp(0, z_NC.shape[1] - 1)
            dz_NC[rows, col] += torch.where(inside, g_N, 0.0)
            dz_NC = dz_NC.to(h_ND.dtype)
            g_h += (dz_NC @ w_CD).float()
            if g_w is not None:
                g_w[start:start + chunk] = dz_NC.t() @ h_ND
        return g_h.to(h_ND.dtype), g_w, None, None


def chunked_logprobs(h_ND: torch.Tensor, w_VD: torch.Tensor, targets_N: torch.Tensor, chunk: int) -> torch.Tensor:
    """float32 [N]: log_softmax(h @ w.T)[n, targets[n]], the vocabulary taken `chunk` rows at a time."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    return _ChunkedLogprobs.apply(h_ND, w_VD, targets_N, chunk)
