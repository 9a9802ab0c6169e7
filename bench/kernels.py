"""Benchmark the MXFP8 kernels at Qwen3-30B-A3B shapes and print measured figures.

    python bench/kernels.py                  # GPU if there is one, else the reduced CPU mode
    python bench/kernels.py --tokens 1,8,64  # choose token counts

GPU mode (what the issue's goals are about), for 1..4096 tokens:
- quantizer GB/s (bytes read + written) against this GPU's measured copy bandwidth (goal >= 70%);
- MoE layer time of the MXFP8 Triton path against the bf16 torch reference (goal >= 1.6x at decode
  sizes), and the fraction of the bandwidth roofline (active experts' bytes / copy bandwidth).
CPU mode (no CUDA): the same layer shapes through the torch paths the server uses on a CPU, the CPU's
copy bandwidth, and the Triton kernels under the interpreter at small shapes for correctness only
(interpreter times say nothing about GPU speed). It says so in its output.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the first import of a @triton.jit module
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import MXFP8Tensor, moe_forward, moe_reference, quantize_mxfp8  # noqa: E402
from kernels.mxfp8 import quantize_mxfp8_reference  # noqa: E402

E, TOP_K, D, INTER = 128, 8, 2048, 768  # Qwen3-30B-A3B: experts, top-k, hidden, expert intermediate
GB = 1e9


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds per call (after one warm-up call)."""
    fn()
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=max(reps, 50), return_mode="median") / 1e3
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """Bytes read + written per second by a plain tensor copy: the practical bandwidth ceiling."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, reps)


def routing(T: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    w, ids = torch.topk(logits.softmax(-1), TOP_K)
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def expert_weights(device: torch.device, seed: int = 0):
    """bf16 w13 [E, 2I, D] and w2 [E, D, I], made one expert at a time to keep host memory low."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w13 = torch.empty(E, 2 * INTER, D, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(E, D, INTER, dtype=torch.bfloat16, device=device)
    for e in range(E):
        w13[e] = (torch.randn(2 * INTER, D, generator=g) / D**0.5).to(device)
        w2[e] = (torch.randn(D, INTER, generator=g) / INTER**0.5).to(device)
    return w13, w2


def quantize_experts(w: torch.Tensor, backend: str) -> MXFP8Tensor:
    """One expert at a time: the torch reference's float32 temporaries for all 128 would not fit."""
    parts = [quantize_mxfp8(w[e], backend=backend) for e in range(w.shape[0])]
    return MXFP8Tensor(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


def active_expert_bytes(ids: torch.Tensor, bytes_per_weight: float) -> float:
    active = int(torch.unique(ids).numel())
    return active * (2 * INTER * D + D * INTER) * bytes_per_weight


def bench_quantizer(device: torch.device, copy_bw: float, token_counts: list[int], reps: int, path: str):
    print(f"\n## Quantizer ({path}), rceil, bf16 in -> fp8 + E8M0 out")
    print(f"{'shape':>18} {'ms':>9} {'GB/s':>8} {'% copy':>7}")
    backend = "triton" if path == "triton" else "torch"
    shapes = [(t, D) for t in token_counts] + [(E * 2 * INTER if device.type == "cuda" else 8 * 2 * INTER, D)]
    for shape in shapes:
        x = torch.randn(shape, device=device).to(torch.bfloat16)
        s = timed(lambda x=x: quantize_mxfp8(x, backend=backend), device, reps)
        nbytes = x.numel() * (2 + 1 + 1 / 32)
        print(f"{str(shape):>18} {s * 1e3:9.3f} {nbytes / s / GB:8.1f} {100 * nbytes / s / copy_bw:6.1f}%")


def bench_moe(device: torch.device, copy_bw: float, token_counts: list[int], reps: int, kernel: bool):
    w13, w2 = expert_weights(device)
    backend = "triton" if kernel else "torch"
    q13, q2 = quantize_experts(w13, backend), quantize_experts(w2, backend)
    mx_path = "MXFP8 Triton kernel" if kernel else "MXFP8 torch reference (CPU serving path)"
    print(f"\n## MoE layer: E={E} top-{TOP_K} D={D} I={INTER}; bf16 torch reference vs {mx_path}")
    print("roofline = active experts' weight bytes / measured copy bandwidth (activations ignored)")
    print(f"{'tokens':>6} {'experts':>7} {'bf16 ms':>9} {'mxfp8 ms':>9} {'speedup':>8} "
          f"{'bf16 %roof':>10} {'mxfp8 %roof':>11}")
    for T in token_counts:
        x = torch.randn(T, D, device=device).to(torch.bfloat16)
        ids, w = routing(T, device, seed=T)
        t_ref = timed(lambda x=x, ids=ids, w=w: moe_reference(x, ids, w, w13, w2), device, reps)
        t_mx = timed(lambda x=x, ids=ids, w=w: moe_forward(x, ids, w, q13, q2, backend=backend), device, reps)
        roof_bf16 = active_expert_bytes(ids, 2) / copy_bw
        roof_mx = active_expert_bytes(ids, 1 + 1 / 32) / copy_bw
        print(f"{T:6d} {int(torch.unique(ids).numel()):7d} {t_ref * 1e3:9.3f} {t_mx * 1e3:9.3f} "
              f"{t_ref / t_mx:7.2f}x {100 * roof_bf16 / t_ref:9.1f}% {100 * roof_mx / t_mx:10.1f}%")


def check_interpreter(token_counts: list[int]):
    """The Triton kernels under the interpreter against the torch references, at reduced shapes."""
    e, k, d, inter = 16, 4, 256, 128
    print(f"\n## Triton kernels under TRITON_INTERPRET=1 (correctness only): E={e} top-{k} D={d} I={inter}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=g).to(torch.bfloat16)
    for mode in ("rceil", "floor"):
        t0 = time.perf_counter()
        data, scales = quantize_mxfp8(x, scale_mode=mode, backend="triton")
        took = time.perf_counter() - t0
        ref = quantize_mxfp8_reference(x, 32, mode)
        exact = torch.equal(data.view(torch.uint8), ref[0].view(torch.uint8)) and \
            torch.equal(scales.view(torch.uint8), ref[1].view(torch.uint8))
        print(f"quantizer {mode} [256, 1024] bf16: bit-exact with reference: {exact} ({took:.2f} s)")
    w13 = torch.randn(e, 2 * inter, d, generator=g) / d**0.5
    w2 = torch.randn(e, d, inter, generator=g) / inter**0.5
    q13, q2 = MXFP8Tensor.quantize(w13, backend="torch"), MXFP8Tensor.quantize(w2, backend="torch")
    print(f"{'tokens':>6} {'mma':>10} {'max |err|':>10} {'max |ref|':>10} {'seconds':>8}")
    for T in token_counts:
        xt = torch.randn(T, d, generator=g)
        logits = torch.randn(T, e, generator=g)
        w, ids = torch.topk(logits.softmax(-1), k)
        for mma in ("dequant", "dot_scaled"):
            t0 = time.perf_counter()
            out = moe_forward(xt, ids, w, q13, q2, backend="triton", mma=mma)
            took = time.perf_counter() - t0
            ref = moe_reference(xt, ids, w, q13, q2, act_mxfp8=mma == "dot_scaled")
            print(f"{T:6d} {mma:>10} {(out - ref).abs().max().item():10.2e} {ref.abs().max().item():10.3f} "
                  f"{took:8.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default=None, help="comma-separated token counts")
    p.add_argument("--reps", type=int, default=None, help="timing repetitions")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU mode: torch threads (default 1: on a shared 2-core machine two threads made "
                        "small ops 10-100x slower and the figures noise)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    default_tokens = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096" if cuda else "1,4,16,64"
    tokens = [int(t) for t in (args.tokens or default_tokens).split(",")]
    reps = args.reps or (100 if cuda else 5)
    print(f"# bench/kernels.py  python {platform.python_version()}  torch {torch.__version__}")
    if cuda:
        print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    else:
        print(f"device: CPU only ({os.cpu_count()} cores, {platform.processor() or platform.machine()}).")
        print("CPU MODE: no CUDA device, so no GPU figures. Timings below are the torch paths a CPU server "
              "runs; the Triton kernels run under the interpreter for correctness only.")
        torch.set_num_threads(args.threads)
        print(f"torch threads: {torch.get_num_threads()}")
    copy_bw = copy_bandwidth(device, (1 << 30) if cuda else (1 << 28), reps)
    print(f"copy bandwidth (read + write): {copy_bw / GB:.1f} GB/s")
    bench_quantizer(device, copy_bw, tokens, reps, "triton" if cuda else "torch reference")
    bench_moe(device, copy_bw, tokens, reps, kernel=cuda)
    if not cuda:
        check_interpreter([1, 8, 32])


if __name__ == "__main__":
    main()
