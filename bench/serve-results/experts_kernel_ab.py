"""The float64 expert kernel alone (moe_experts_f64, bfloat16 weights as the engine serves them), an earlier
build against this one, calls alternating: T tokens of the built-in model's shape (8 experts, top 2,
D = I = 128) sent to the same two experts or to random ones, with the weights warm in cache or evicted
(a 32 MiB write between calls); outputs checked bitwise equal. Usage: python
bench/serve-results/experts_kernel_ab.py DIR (an earlier build's folder under ~/.cache/composer/kernels). Issue 50."""

# ruff: noqa: E402 (the repository root goes on sys.path first)
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch

from bench.step_ab import earlier_build
from kernels import cpu_ext

torch.set_num_threads(1)
old = earlier_build(sys.argv[1])
new = cpu_ext.build()
E, INTER, D, K = 8, 128, 128, 2
g = torch.Generator().manual_seed(0)
w13 = torch.randn(E, 2 * INTER, D, generator=g, dtype=torch.float64).to(torch.bfloat16)
w2 = torch.randn(E, D, INTER, generator=g, dtype=torch.float64).to(torch.bfloat16)
big = torch.randn(4 << 20, dtype=torch.float64)
for mode in ("same", "random"):
    for T in (1, 2, 5, 9):
        x = torch.randn(T, D, generator=g, dtype=torch.float64)
        ids = (torch.tensor([[1, 5]] * T) if mode == "same"
               else torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]))
        w = torch.rand(T, K, generator=g, dtype=torch.float64)
        assert torch.equal(old.moe_experts_f64(x, ids, w, w13, w2), new.moe_experts_f64(x, ids, w, w13, w2))
        for evict in (False, True):
            ts: dict[str, list[float]] = {"before": [], "now": []}
            for i in range(400):
                for arm, mod in (("before", old), ("now", new)) if i % 2 else (("now", new), ("before", old)):
                    if evict:
                        big.add_(1.0)
                    t = time.perf_counter()
                    mod.moe_experts_f64(x, ids, w, w13, w2)
                    ts[arm].append(time.perf_counter() - t)
            a, b = statistics.median(ts["before"][20:]), statistics.median(ts["now"][20:])
            print(f"{mode} experts, {T} tokens, {'evicted' if evict else 'warm'}: before {a * 1e6:.1f} us, "
                  f"now {b * 1e6:.1f} us: {b / a:.2f}x", flush=True)
