"""Test data for the MoE layer."""

from __future__ import annotations

import torch


def make_layer(T: int, E: int, K: int, D: int, inter: int, seed: int = 0, skew: bool = False):
    """Router outputs as Qwen3-MoE makes them (softmax, top-k, renormalised) and scaled random experts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g)
    if skew:  # most tokens pick the first experts; the last ones get nobody
        logits += torch.linspace(6, -6, E)
    weights, ids = torch.topk(logits.softmax(-1), K)
    weights = weights / weights.sum(-1, keepdim=True)
    w13 = torch.randn(E, 2 * inter, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, inter, generator=g) / inter**0.5
    return x, ids, weights, w13, w2
