"""Benchmark the MXFP8 kernels at Qwen3-30B-A3B shapes and print measured figures.

    python bench/kernels.py                  # GPU if there is one, else the reduced CPU mode
    python bench/kernels.py --tokens 1,8,64  # choose token counts

GPU mode (what the issue's goals are about), tokens 1, 8, 64, 512, 4096 (about a minute in all):
- quantizer GB/s (bytes read + written) against this GPU's measured copy bandwidth (goal >= 70%);
- MoE layer time of the MXFP8 Triton path against the strong bf16 baseline, torch's grouped GEMM
  (`torch.nn.functional.grouped_mm` / `torch._grouped_mm`, what transformers' experts_implementation=
  "grouped_mm" runs; goal >= 1.6x at decode sizes), and the bf16 per-expert loop (`moe_reference`) for
  reference; for both MXFP8 and grouped bf16, the fraction of the bandwidth roofline (the distinct routed
  experts' weight bytes in that format / measured copy bandwidth: what decode sizes are bound by) and the
  TFLOP/s of useful work (2 * 3 * T * K * D * I / time: what prefill sizes are bound by), next to a
  measured dense bf16 matmul's TFLOP/s.
CPU mode (no CUDA): the same layer shapes through the torch paths the server uses on a CPU, the CPU's
copy bandwidth, and the Triton kernels under the interpreter at small shapes for correctness only
(interpreter times say nothing about GPU speed). It says so in its output.

`moe_row` returns one MoE row as a dict (bench/gpu.py records them in its JSON).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # must precede the first import of a @triton.jit module
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import MXFP8Tensor, moe_forward, moe_reference, quantize_mxfp8  # noqa: E402
from kernels.moe_reference import acc_dtype  # noqa: E402
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
    """bf16 w13 [E, 2I, D] and w2 [E, D, I], made one expert at a time to keep memory low (on the GPU
    itself where there is one: the CPU's random numbers for 128 experts take seconds)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(E, 2 * INTER, D, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(E, D, INTER, dtype=torch.bfloat16, device=device)
    for e in range(E):
        w13[e] = torch.randn(2 * INTER, D, generator=g, device=device) / D**0.5
        w2[e] = torch.randn(D, INTER, generator=g, device=device) / INTER**0.5
    return w13, w2


def quantize_experts(w: torch.Tensor, backend: str) -> MXFP8Tensor:
    """One expert at a time: the torch reference's float32 temporaries for all 128 would not fit."""
    parts = [quantize_mxfp8(w[e], backend=backend) for e in range(w.shape[0])]
    return MXFP8Tensor(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


def active_expert_bytes(ids: torch.Tensor, bytes_per_weight: float) -> float:
    """Bytes of the weights of the distinct experts `ids` routes to (w13 and w2), at `bytes_per_weight`."""
    active = int(torch.unique(ids).numel())
    return active * (2 * INTER * D + D * INTER) * bytes_per_weight


def moe_flops(T: int, k: int, d: int, inter: int) -> float:
    """Useful FLOPs of one MoE layer: per routed pair, gate_up (2I x D) and down (D x I) matmuls."""
    return 2 * 3 * T * k * d * inter


def _grouped_mm_fn():
    """torch.nn.functional.grouped_mm where torch has it (2.10+), else torch._grouped_mm (2.8+), as
    transformers' integrations/moe.py `_grouped_mm` picks."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def moe_grouped_mm_bf16(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                        w13_END: torch.Tensor, w2_EDI: torch.Tensor) -> torch.Tensor:
    """The MoE layer in x's dtype through torch's grouped GEMM, the way transformers'
    `grouped_mm_experts_forward` (experts_implementation="grouped_mm") runs Qwen3-MoE experts: sort the
    T*K (token, expert) pairs by expert, gather their rows, per-expert offsets (cumsum of the counts,
    int32) made on the device (no host sync), one grouped GEMM against w13 [E, 2I, D] viewed as
    [E, D, 2I] (a transpose view, no copy: the column-major operand the CUDA kernel wants), SwiGLU, one
    against w2 viewed as [E, I, D], router weights, then the pairs back in token order and summed over
    the K slots. The one difference from transformers: the weighting and the sum over K run in float32
    and round once (as `moe_reference` does; transformers weights in bf16, then sums in float32).
    bf16, fp16 and float32 x (torch has no float64 grouped_mm); CUDA needs sm_80+ (sm_90 before torch
    2.9) and row strides that are multiples of 16 bytes (D and I multiples of 8 in bf16)."""
    grouped_mm = _grouped_mm_fn()
    if grouped_mm is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm")
    T, d = x_TD.shape
    K = ids_TK.shape[1]
    n_experts, inter = w13_END.shape[0], w2_EDI.shape[2]
    expert_P = ids_TK.reshape(-1)
    expert_sorted_P, order_P = torch.sort(expert_P, stable=True)
    x_PD = x_TD[order_P // K]
    counts_E = torch.zeros(n_experts, dtype=torch.int32, device=x_TD.device)
    counts_E.scatter_add_(0, expert_sorted_P, torch.ones_like(expert_sorted_P, dtype=torch.int32))
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    gate_up_P2I = grouped_mm(x_PD, w13_END.transpose(-2, -1), offs=offs_E)
    h_PI = F.silu(gate_up_P2I[:, :inter]) * gate_up_P2I[:, inter:]
    y_PD = grouped_mm(h_PI, w2_EDI.transpose(-2, -1), offs=offs_E)
    acc = acc_dtype(x_TD.dtype)
    weighted_PD = y_PD.to(acc) * weights_TK.reshape(-1)[order_P, None].to(acc)
    unsorted_PD = torch.empty_like(weighted_PD)
    unsorted_PD[order_P] = weighted_PD  # a permutation: deterministic, unlike index_add_'s atomics
    return unsorted_PD.view(T, K, d).sum(1).to(x_TD.dtype)


def grouped_mm_problem(device: torch.device) -> str | None:
    """None when `moe_grouped_mm_bf16` runs in bf16 on `device`, else why not (old torch, pre-sm_80 GPU)."""
    try:
        x = torch.randn(4, 64, device=device).to(torch.bfloat16)
        ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 2]], device=device)
        w = torch.full((4, 2), 0.5, device=device)
        w13 = torch.randn(4, 64, 64, device=device).to(torch.bfloat16)
        w2 = torch.randn(4, 64, 32, device=device).to(torch.bfloat16)
        moe_grouped_mm_bf16(x, ids, w, w13, w2)
        return None
    except Exception as e:  # noqa: BLE001 - the reason is printed and recorded, the loop stands in
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def matmul_tflops(device: torch.device, reps: int) -> float:
    """A dense bf16 matmul's TFLOP/s (8192^3 on a GPU, 1024^3 on a CPU): the practical compute ceiling."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    return 2 * n**3 / timed(lambda: a @ b, device, reps) / 1e12


def moe_row(T: int, device: torch.device, copy_bw: float, reps: int, w13: torch.Tensor, w2: torch.Tensor,
            q13: MXFP8Tensor, q2: MXFP8Tensor, backend: str, loop: bool = True,
            grouped_problem: str | None = None) -> dict:
    """One MoE row: the MXFP8 path (`backend`) against bf16 grouped_mm (the per-expert loop stands in
    where `grouped_problem` says grouped_mm cannot run) and, if `loop`, the bf16 per-expert loop.
    `bf16_*` keys are the bf16 baseline (grouped_mm unless `bf16_impl` says otherwise)."""
    x = torch.randn(T, D, device=device).to(torch.bfloat16)
    ids, w = routing(T, device, seed=T)
    t_mx = timed(lambda: moe_forward(x, ids, w, q13, q2, backend=backend), device, reps)
    t_loop = timed(lambda: moe_reference(x, ids, w, w13, w2), device, reps) if loop or grouped_problem else None
    if grouped_problem is None:
        t_bf16 = timed(lambda: moe_grouped_mm_bf16(x, ids, w, w13, w2), device, reps)
        impl = "torch.nn.functional.grouped_mm" if hasattr(F, "grouped_mm") else "torch._grouped_mm"
    else:
        t_bf16, impl = t_loop, f"per-expert loop (grouped_mm unavailable: {grouped_problem})"
    flops = moe_flops(T, TOP_K, D, INTER)
    row = {"kind": "moe", "tokens": T, "experts_active": int(torch.unique(ids).numel()), "bf16_impl": impl,
           "mxfp8_ms": t_mx * 1e3, "bf16_ms": t_bf16 * 1e3, "speedup": t_bf16 / t_mx,
           "mxfp8_pct_roof": 100 * active_expert_bytes(ids, 1 + 1 / 32) / copy_bw / t_mx,
           "bf16_pct_roof": 100 * active_expert_bytes(ids, 2) / copy_bw / t_bf16,
           "mxfp8_tflops": flops / t_mx / 1e12, "bf16_tflops": flops / t_bf16 / 1e12}
    if t_loop is not None:
        row.update(bf16_loop_ms=t_loop * 1e3, speedup_vs_loop=t_loop / t_mx)
    return row


MOE_COLUMNS = [  # (key, header, format) of the MoE table
    ("tokens", "tokens", "d"), ("experts_active", "experts", "d"), ("mxfp8_ms", "mxfp8 ms", ".3f"),
    ("bf16_ms", "gmm ms", ".3f"), ("bf16_loop_ms", "loop ms", ".3f"), ("speedup", "vs gmm", ".2f"),
    ("speedup_vs_loop", "vs loop", ".2f"), ("mxfp8_pct_roof", "mx %roof", ".1f"),
    ("bf16_pct_roof", "gmm %roof", ".1f"), ("mxfp8_tflops", "mx TF/s", ".3f"), ("bf16_tflops", "gmm TF/s", ".3f")]


def print_moe_row(row: dict, header: bool = False) -> None:
    width = {k: max(len(h), 8) for k, h, _ in MOE_COLUMNS}
    if header:
        print(" ".join(f"{h:>{width[k]}}" for k, h, _ in MOE_COLUMNS))
    print(" ".join(f"{row[k]:>{width[k]}{f}}" if k in row else f"{'-':>{width[k]}}" for k, _, f in MOE_COLUMNS),
          flush=True)


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


def bench_moe(device: torch.device, copy_bw: float, token_counts: list[int], reps: int, kernel: bool,
              loop: bool = True) -> list[dict]:
    w13, w2 = expert_weights(device)
    backend = "triton" if kernel else "torch"
    q13, q2 = quantize_experts(w13, backend), quantize_experts(w2, backend)
    problem = grouped_mm_problem(device)
    mx_path = "MXFP8 Triton kernel" if kernel else "MXFP8 torch reference (CPU serving path)"
    gmm = f"bf16 {'torch.nn.functional.grouped_mm' if hasattr(F, 'grouped_mm') else 'torch._grouped_mm'}"
    print(f"\n## MoE layer: E={E} top-{TOP_K} D={D} I={INTER}; {mx_path} vs bf16 grouped GEMM (gmm)")
    if problem:
        print(f"NOTE: grouped_mm cannot run here ({problem}): the gmm columns are the bf16 per-expert loop")
    else:
        print(f"gmm = {gmm} (transformers' grouped_mm experts); loop = bf16 per-expert loop (moe_reference)")
    print("%roof = (distinct routed experts' weight bytes in that format / copy bandwidth) / time; "
          "TF/s = 2*3*T*K*D*I / time")
    rows = []
    for i, T in enumerate(token_counts):
        rows.append(moe_row(T, device, copy_bw, reps, w13, w2, q13, q2, backend, loop, problem))
        print_moe_row(rows[-1], header=i == 0)
    return rows


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
    p.add_argument("--no-loop", action="store_true", help="leave out the bf16 per-expert loop column")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    default_tokens = "1,8,64,512,4096" if cuda else "1,4,16,64"
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
    print(f"dense bf16 matmul: {matmul_tflops(device, reps):.1f} TFLOP/s")
    bench_quantizer(device, copy_bw, tokens, reps, "triton" if cuda else "torch reference")
    bench_moe(device, copy_bw, tokens, reps, kernel=cuda, loop=not args.no_loop)
    if not cuda:
        check_interpreter([1, 8, 32])


if __name__ == "__main__":
    main()
