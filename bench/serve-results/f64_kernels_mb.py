"""The float64 kernels alone against the torch paths they replace (issue 50, BENCHMARKS): few-query attention
(kernels/csrc/few_query_attention_cpu.cpp against serve/model/layers.py few_query_attention on the gathered
keys) at 1/5/9 query rows over 500-3,000 keys, and the experts' few rows (kernels/csrc/moe_f64_cpu.cpp against
kernels/moe_reference.py moe_grouped_cpu) at 1-64 rows; one thread, medians of 200-300 calls, the largest
difference printed beside each. Usage: python bench/serve-results/f64_kernels_mb.py."""

# ruff: noqa: E402 (the repository root goes on sys.path first)
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch

from kernels import cpu_ext
from kernels.moe_reference import moe_grouped_cpu
from serve.model.layers import few_query_attention

torch.set_num_threads(1)
m = cpu_ext.build()


def median_us(n, fn, *args):
    for _ in range(20):
        fn(*args)
    xs = []
    for _ in range(n):
        a = time.perf_counter()
        fn(*args)
        xs.append(time.perf_counter() - a)
    return sorted(xs)[len(xs) // 2] * 1e6


def gathered(q, k, v, slots):
    """The torch path as the server ran it: the context's K/V gathered out of the pages, then attention."""
    return few_query_attention(q, k.index_select(0, slots), v.index_select(0, slots), slots.shape[0] - q.shape[0])


S = 8192
for H, G, C in ((8, 4, 16), (16, 4, 64)):
    for L in (500, 1400, 3000):
        k, v = (torch.randn(S, G, C, dtype=torch.float64) for _ in range(2))
        slots = torch.randperm(S)[:L]
        for Q in (1, 5, 9):
            q = torch.randn(Q, H, C, dtype=torch.float64)
            err = (gathered(q, k, v, slots) - m.few_query_attention(q, k, v, slots, C ** -0.5)).abs().max().item()
            a = median_us(200, gathered, q, k, v, slots)
            b = median_us(200, m.few_query_attention, q, k, v, slots, C ** -0.5)
            print(f"attention, {H} heads of {C} over {G}, {L} keys, {Q} rows: torch {a:.0f} us, kernel {b:.0f} us "
                  f"({a / b:.2f}x), max diff {err:.1e}", flush=True)
for E, D, inter, K in ((8, 128, 128, 2), (16, 256, 128, 4)):
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * inter, D, generator=g, dtype=torch.float64) / 10
    w2 = torch.randn(E, D, inter, generator=g, dtype=torch.float64) / 10
    for T in (1, 2, 5, 9, 16, 64):
        x = torch.randn(T, D, generator=g, dtype=torch.float64)
        w, ids = torch.softmax(torch.randn(T, E, generator=g, dtype=torch.float64), -1).topk(K, -1)
        ids, w = ids.contiguous(), w.contiguous()
        ref = moe_grouped_cpu(x, ids, w, w13, w2)
        err = ((ref - m.moe_experts_f64(x, ids, w, w13, w2)).abs().max() / ref.abs().max()).item()
        a = median_us(300, moe_grouped_cpu, x, ids, w, w13, w2)
        b = median_us(300, m.moe_experts_f64, x, ids, w, w13, w2)
        print(f"experts, {E} of [{2 * inter}, {D}] + [{D}, {inter}], top-{K}, {T} rows: torch {a:.0f} us, kernel {b:.0f} us "
              f"({a / b:.2f}x), max relative diff {err:.1e}", flush=True)
