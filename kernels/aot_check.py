"""Compile every Triton kernel of ours for a GPU architecture, on a machine without one.

    python -m kernels.aot_check [--arch 90] [--arch 100]

The Triton interpreter runs a kernel's logic on the CPU, but not Triton's compiler: a shape tl.dot
refuses, a dtype an MMA does not take, a construct the code generator does not implement, or a tile
that overflows shared memory show up only when the kernel is compiled for a GPU. Triton compiles ahead
of time for any target without the GPU being there (its wheel carries ptxas), so this runs each wrapper
(kernels/*_triton.py) at the Qwen3-30B-A3B shapes the serving path uses, on CPU tensors, with the kernel
objects swapped for recorders that take each launch's arguments, and compiles those launches for the
target (every autotuning candidate too) down to a cubin. Exits 1 and names the kernel if any fails.

It must run with TRITON_INTERPRET unset (kernels defined under the interpreter are not compilable).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

SHARED_MEMORY_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 and sm_100 (227 KiB)
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}


class Recorder:
    """Stands in for a JITFunction or an Autotuner: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, name: str, kernel):
        self.name, self.kernel = name, kernel
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _signature(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of one launch of JITFunction `fn`."""
    from triton.runtime.jit import JITFunction

    assert isinstance(fn, JITFunction), fn
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs  # positional first, then keywords
    sig, consts = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + DTYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {p.name}={v!r}")
    return sig, consts, options


def _alignment(fn, args: tuple, kwargs: dict) -> dict:
    """The divisibility a real launch tells the compiler (triton's launcher specialises every 16-byte-aligned
    pointer and every int divisible by 16): without it the compiler cannot prove a load's alignment, emits
    byte loads instead of 16-byte cp.async copies, and pipelines nothing through shared memory, so the
    shared memory checked here would be far below what the GPU's launch asks for."""
    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    attrs = {}
    for i, p in enumerate(fn.params):
        v = values.get(p.name)
        if p.is_constexpr:
            continue
        if (isinstance(v, torch.Tensor) and v.data_ptr() % 16 == 0) or (type(v) is int and v % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_calls(rec: Recorder, arch: int) -> int:
    """Compile every recorded launch (each autotuning config of an Autotuner); returns how many."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner

    target = GPUTarget("cuda", arch, 32)
    n = 0
    for args, kwargs in rec.calls:
        if isinstance(rec.kernel, Autotuner):
            variants = [(rec.kernel.fn, {**kwargs, **c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages})
                        for c in rec.kernel.configs]
        else:
            variants = [(rec.kernel, dict(kwargs))]
        for fn, kw in variants:
            attrs = _alignment(fn, args, kw)
            sig, consts, options = _signature(fn, args, kw)
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target,
                                      options=options)
            if compiled.metadata.shared > SHARED_MEMORY_LIMIT:  # the launch would fail on the GPU
                raise RuntimeError(f"{fn.__name__} {consts} {options}: {compiled.metadata.shared} bytes of shared "
                                   f"memory, past the {SHARED_MEMORY_LIMIT} a block may have on sm_90/sm_100")
            n += 1
    return n


def _cases() -> list[tuple[str, Callable[[], None]]]:
    """The wrappers at the serving path's shapes: (what, call). Qwen3-30B-A3B: D 2048, 32 query heads and 4
    kv heads of 128, 128 experts top-8 with I 768 (8 experts here: their count changes no code), bf16."""
    from kernels import batch_invariant_triton as bi
    from kernels.fp8_linear_triton import fp8_linear_triton
    from kernels.fused_triton import add_rms_norm_triton, qk_norm_rope_cache_triton, router_topk_triton
    from kernels.lm_head_triton import fused_chunked_logprobs
    from kernels.moe_align_triton import moe_align_block_size_triton
    from kernels.moe_decode_triton import fused_moe_mxfp8_decode
    from kernels.moe_decode_variants import KernelTiles, VariantConfig, moe_decode_variant
    from kernels.moe_triton import fused_moe_mxfp8
    from kernels.mxfp8 import MXFP8Tensor
    from kernels.mxfp8_triton import dequantize_mxfp8_triton, quantize_mxfp8_triton
    from kernels.paged_attention_triton import paged_decode_attention_triton
    from kernels.rms_norm_triton import rms_norm_train
    from kernels.swiglu_triton import swiglu_backward_triton

    bf16 = torch.bfloat16
    D, H, G, C, E, K, inter, bs = 2048, 32, 4, 128, 8, 8, 768, 16
    slots = 64 * bs
    w13 = MXFP8Tensor(torch.zeros(E, 2 * inter, D, dtype=torch.float8_e4m3fn),
                      torch.zeros(E, 2 * inter, D // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    w2 = MXFP8Tensor(torch.zeros(E, D, inter, dtype=torch.float8_e4m3fn),
                     torch.zeros(E, D, inter // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu))

    def moe(T: int, **kw) -> Callable[[], None]:
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        return lambda: fused_moe_mxfp8(torch.zeros(T, D, dtype=bf16), ids, torch.ones(T, K, dtype=bf16), w13, w2, **kw)

    def attention(B: int, N: int, splits: int | None) -> Callable[[], None]:
        tables = torch.zeros(B, N, dtype=torch.int32)
        return lambda: paged_decode_attention_triton(torch.zeros(B, H, C, dtype=bf16), torch.zeros(slots, G, C, dtype=bf16),
                                                     torch.zeros(slots, G, C, dtype=bf16), tables,
                                                     torch.ones(B, dtype=torch.int32), bs, C**-0.5, num_splits=splits)

    # tests/kernels/test_moe.py's "few-tokens" shape: D and I not powers of two (tile widths must be)
    sd, si = 96, 32
    s13 = MXFP8Tensor(torch.zeros(E, 2 * si, sd, dtype=torch.float8_e4m3fn),
                      torch.zeros(E, 2 * si, sd // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    s2 = MXFP8Tensor(torch.zeros(E, sd, si, dtype=torch.float8_e4m3fn),
                     torch.zeros(E, sd, si // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    T = 8

    def fp8(M: int, N: int, K: int) -> Callable[[], None]:  # block-FP8 dense layers (--quant-dense fp8)
        return lambda: fp8_linear_triton(torch.zeros(M, K, dtype=bf16), torch.zeros(N, K, dtype=torch.float8_e4m3fn),
                                         torch.ones(-(-N // 128), -(-K // 128)))

    def variant(T: int, name: str, split: int, gate_up: KernelTiles, down: KernelTiles,
                fused: bool = False) -> Callable[[], None]:
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        cfg = VariantConfig(name, gate_up, down, split, fused)
        return lambda: moe_decode_variant(torch.zeros(T, D, dtype=bf16), ids, torch.ones(T, K, dtype=bf16), w13, w2, cfg)

    return [
        # the decode MoE variants the tuner picks from (kernels/moe_decode_variants.py), at the widest tiles
        # of its GPU candidates (bench/gpu_tune.py): split-K partials, swap-AB, the broadcast GEMV
        ("moe decode variant dot, 1 token, split 4", variant(1, "dot", 4, KernelTiles(32, 256, 4, 4),
                                                             KernelTiles(64, 128, 4, 2))),
        ("moe decode variant swap, 1 token, split 8", variant(1, "swap", 8, KernelTiles(64, 256, 4, 4),
                                                              KernelTiles(128, 64, 4, 2))),
        ("moe decode variant fma, 4 tokens, split 2", variant(4, "fma", 2, KernelTiles(16, 256, 4, 3),
                                                              KernelTiles(32, 256, 4, 3))),
        ("moe decode variant dot, 64 tokens", variant(64, "dot", 1, KernelTiles(32, 128, 4, 3),
                                                      KernelTiles(64, 128, 8, 3))),
        ("moe decode variant swap, 32 tokens, split 2", variant(32, "swap", 2, KernelTiles(64, 128, 4, 3),
                                                                KernelTiles(64, 128, 4, 3))),
        # gate_up and down in one launch (+ the sum of its partials), at the GPU candidates' tiles
        ("moe decode fused dot, 1 token", variant(1, "dot", 1, KernelTiles(32, 256, 4, 3), KernelTiles(64, 256, 4, 1),
                                                  True)),
        ("moe decode fused dot, 16 tokens, wide tiles", variant(16, "dot", 1, KernelTiles(32, 128, 4, 4),
                                                                KernelTiles(128, 512, 4, 1), True)),
        ("moe decode fused dot, 32 tokens", variant(32, "dot", 1, KernelTiles(64, 128, 4, 3),
                                                    KernelTiles(64, 256, 4, 1), True)),
        ("moe decode fused swap, 8 tokens", variant(8, "swap", 1, KernelTiles(64, 128, 4, 3),
                                                    KernelTiles(128, 256, 4, 1), True)),
        ("moe decode fused fma, 1 token", variant(1, "fma", 1, KernelTiles(32, 256, 4, 3),
                                                   KernelTiles(32, 256, 4, 1), True)),
        ("fp8 linear, o projection, 1 row (split-K)", fp8(1, D, H * C)),
        ("fp8 linear, q/k/v, 64 rows", fp8(64, (H + 2 * G) * C, D)),
        ("fp8 linear, LM head, 4096-row prefill", fp8(4096, 151936, D)),
        ("moe decode, D 96 and I 32", lambda: fused_moe_mxfp8_decode(
            torch.zeros(7, sd, dtype=bf16), torch.stack([torch.randperm(E)[:2] for _ in range(7)]),
            torch.ones(7, 2, dtype=bf16), s13, s2)),
        ("moe grouped, D 96 and I 32", lambda: fused_moe_mxfp8(
            torch.zeros(40, sd, dtype=bf16), torch.stack([torch.randperm(E)[:2] for _ in range(40)]),
            torch.ones(40, 2, dtype=bf16), s13, s2, mma="dequant", autotune=False)),
        ("add_rms_norm", lambda: add_rms_norm_triton(torch.zeros(T, D, dtype=bf16), torch.zeros(T, D, dtype=bf16),
                                                     torch.ones(D, dtype=bf16), 1e-6)),
        ("qk_norm_rope_cache", lambda: qk_norm_rope_cache_triton(
            torch.zeros(T, (H + 2 * G) * C, dtype=bf16), torch.ones(C, dtype=bf16), torch.ones(C, dtype=bf16), 1e-6,
            torch.zeros(T, C, dtype=bf16), torch.zeros(T, C, dtype=bf16), torch.zeros(slots, G, C, dtype=bf16),
            torch.zeros(slots, G, C, dtype=bf16), torch.arange(T), H)),
        ("router_topk", lambda: router_topk_triton(torch.zeros(T, 128, dtype=bf16), K, True)),
        ("add_rms_norm of per-pair rows", lambda: add_rms_norm_triton(
            torch.zeros(T, K, D, dtype=torch.float32), torch.zeros(T, D, dtype=bf16), torch.ones(D, dtype=bf16), 1e-6)),
        ("router_topk recording routes", lambda: router_topk_triton(
            torch.zeros(T, 128, dtype=bf16), K, True, (torch.zeros(slots, 48, K, dtype=torch.int16), torch.arange(T), 3))),
        ("paged attention, one split", attention(4, 8, 1)),
        ("paged attention, 16 splits", attention(4, 2560, None)),
        ("moe align", lambda: moe_align_block_size_triton(torch.stack([torch.randperm(E)[:K] for _ in range(64)]),
                                                          16, E)),
        ("moe decode, 1 token", lambda: fused_moe_mxfp8_decode(torch.zeros(1, D, dtype=bf16),
                                                              torch.randperm(E)[:K][None], torch.ones(1, K, dtype=bf16),
                                                              w13, w2)),
        ("moe decode, 16 tokens", lambda: fused_moe_mxfp8_decode(
            torch.zeros(16, D, dtype=bf16), torch.stack([torch.randperm(E)[:K] for _ in range(16)]),
            torch.ones(16, K, dtype=bf16), w13, w2)),
        ("moe grouped, 64 tokens, fixed tiles", moe(64, mma="dequant", autotune=False)),
        ("moe grouped, 512 tokens, autotune candidates", moe(512, mma="dequant", autotune=True)),
        ("moe grouped, 512 tokens, dot_scaled (sm_100)", moe(512, mma="dot_scaled", autotune=False)),
        ("batch-invariant matmul and norms", lambda: (
            bi.matmul(torch.zeros(T, D, dtype=bf16), torch.zeros((H + 2 * G) * C, D, dtype=bf16)),
            bi.rms_norm(torch.zeros(T, H, C, dtype=bf16), torch.ones(C, dtype=bf16), 1e-6),
            bi.log_softmax(torch.zeros(T, 151936)))),
        ("batch-invariant moe, MXFP8 in registers", lambda: bi.moe(
            torch.zeros(T, D, dtype=bf16), torch.stack([torch.randperm(E)[:K] for _ in range(T)]),
            torch.ones(T, K, dtype=bf16), w13, w2)),
        ("batch-invariant attention, paged decode and a dense sequence", lambda: (
            bi.attention(torch.zeros(4, 1, H, C, dtype=bf16), torch.zeros(slots, G, C, dtype=bf16),
                         torch.zeros(slots, G, C, dtype=bf16), torch.ones(4, 1, dtype=torch.int32),
                         torch.zeros(4, 8, dtype=torch.int32), bs),
            bi.attention(torch.zeros(1, 64, H, C, dtype=bf16), torch.zeros(1, G, 64, C, dtype=bf16),
                         torch.zeros(1, G, 64, C, dtype=bf16), torch.ones(1, 64, dtype=torch.int32)))),
        ("mxfp8 quantize", lambda: quantize_mxfp8_triton(torch.zeros(256, D, dtype=bf16))),
        ("swiglu backward (the trainer's experts), I 768", lambda: swiglu_backward_triton(
            torch.zeros(T * K, 2 * inter, dtype=bf16), torch.zeros(T * K, inter, dtype=bf16), torch.ones(T * K))),
        ("rms norm for training, forward and backward, hidden and head rows", lambda: [
            rms_norm_train(torch.zeros(T, n, dtype=bf16, requires_grad=True), torch.ones(n, dtype=bf16), 1e-6)
            .backward(torch.ones(T, n, dtype=bf16)) for n in (D, C)]),
        ("LM head slices for training (16,384 rows), forward and backward", lambda: fused_chunked_logprobs(
            torch.zeros(T, D, dtype=bf16, requires_grad=True), torch.zeros(16384, D, dtype=bf16), torch.zeros(T, dtype=torch.long),
            16384).sum().backward()),
        ("mxfp8 dequantize", lambda: dequantize_mxfp8_triton(w2.data[0], w2.scales[0], bf16)),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, action="append", help="compute capability x 10 (default: 90 and 100)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: kernels defined under the interpreter cannot be compiled", file=sys.stderr)
        return 2
    import triton
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    import kernels.batch_invariant_triton
    import kernels.fp8_linear_triton
    import kernels.fused_triton
    import kernels.lm_head_triton
    import kernels.moe_align_triton
    import kernels.moe_decode_triton
    import kernels.moe_decode_variants
    import kernels.moe_triton
    import kernels.mxfp8_triton
    import kernels.paged_attention_triton
    import kernels.rms_norm_triton
    import kernels.swiglu_triton

    modules = [kernels.batch_invariant_triton, kernels.fp8_linear_triton, kernels.fused_triton, kernels.moe_align_triton, kernels.moe_decode_triton,
               kernels.moe_decode_variants, kernels.moe_triton,
               kernels.mxfp8_triton, kernels.paged_attention_triton, kernels.rms_norm_triton, kernels.lm_head_triton,
               kernels.swiglu_triton]
    failed = 0
    for arch in args.arch or [90, 100]:
        for what, call in _cases():
            if "dot_scaled" in what and arch < 100:
                continue  # sm_90 has no block-scaled MMA: default_mma never picks it there
            recorders = []
            for mod in modules:
                for name, obj in list(vars(mod).items()):
                    if isinstance(obj, (JITFunction, Autotuner)) and not name.startswith("__"):
                        rec = Recorder(f"{mod.__name__}.{name}", obj)
                        setattr(mod, name, rec)
                        recorders.append((mod, name, rec))
            t0 = time.perf_counter()
            try:
                try:
                    call()
                finally:  # the @jit helpers the kernels call must be themselves again before compiling
                    for mod, name, rec in recorders:
                        setattr(mod, name, rec.kernel)
                launched = [rec for _, _, rec in recorders if rec.calls]
                n = sum(compile_calls(rec, arch) for rec in launched)
                names = ", ".join(sorted(rec.name.rsplit(".", 1)[1] for rec in launched))
                print(f"sm_{arch}: {what}: {n} compiled ({names}) in {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - report each failure and go on
                failed += 1
                print(f"sm_{arch}: {what}: FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    print(f"triton {triton.__version__}: {'all compiled' if not failed else f'{failed} failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
