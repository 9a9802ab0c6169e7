"""x @ W.T for a block-FP8 weight (kernels/fp8_block.py), in Triton: W8A16, one kernel for decode and prefill.

Grid (M tiles, N tiles, SPLIT_K). A program streams a [BLOCK_N, BLOCK_K] tile of e4m3 codes per step (one
byte a weight: half of bf16's traffic, which is what a decode step is bound by), converts them to the
activations' dtype (exact: every e4m3 value is a bf16 value), multiplies a [BLOCK_M, BLOCK_K] tile of x with
tl.dot into float32, and scales that partial product by the step's block scale per output column before
adding it to the accumulator: BLOCK_K divides the scale block (128), so one scale per row and step, applied
on the [M, N] tile rather than on every weight.

Decode shapes (M <= 64 rows: batch, or speculative verification) have few N tiles for a 132-SM GPU (the
o projection of Qwen3-30B: N = 2,048), so the reduction is split over SPLIT_K programs that write float32
partials, summed by torch (a sum and a cast), or, with reduce=False, handed over as [M, SPLIT_K, N] for the
next kernel to add (the decode step's o projection: kernels/fused.py's add + RMSNorm adds them as it adds a
MoE layer's per-pair rows, two kernels a layer fewer); the split is a function of the shapes only, so the step stays capturable
in a CUDA graph (nothing read on the host, no data-dependent grid). Prefill shapes use 64-128-row tiles: the
same kernel as an FP8-weight GEMM with bf16 MMA (torch._scaled_mm would need the activations quantized to
FP8 as well, a second rounding this W8A16 path avoids; on Hopper the prefill GEMM is compute-bound either
way at bf16 rates).

Limits: the tile sizes are first guesses, not tuned on a GPU; under TRITON_INTERPRET=1 the dot runs in
float32 (the interpreter has no bf16 arithmetic), so tests check the kernel against the float32 reference.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from kernels.backend import interpreting
from kernels.launches import launch
from kernels.tuning import DTYPES, lookup

DECODE_MAX_ROWS = 64


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, k_per_split,
                       stride_xm, stride_wn, stride_sn, stride_om, stride_os,
                       HAS_BIAS: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m_M = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n_N = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ok_M, ok_N = m_M < M, n_N < N
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s_row = s_ptr + (n_N // SCALE_N) * stride_sn
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_K = k0 + tl.arange(0, BLOCK_K)
        ok_K = k_K < k_end
        x = tl.load(x_ptr + m_M[:, None] * stride_xm + k_K[None, :], mask=ok_M[:, None] & ok_K[None, :], other=0.0)
        w = tl.load(w_ptr + n_N[:, None] * stride_wn + k_K[None, :], mask=ok_N[:, None] & ok_K[None, :], other=0.0)
        s_N = tl.load(s_row + k0 // SCALE_K, mask=ok_N, other=0.0)
        if F32_DOT:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        acc += part * s_N[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n_N, mask=ok_N, other=0.0).to(tl.float32)[None, :]
    dest = out_ptr + pid_s * stride_os + m_M[:, None] * stride_om + n_N[None, :]
    tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=ok_M[:, None] & ok_N[None, :])


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tiles(M: int, N: int, K: int, device: torch.device, interpret: bool,
          dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for these shapes: a function of the shapes
    only (a captured step replays the same launch). The device's tuned table (kernels/tuning.py, written by
    `bench/gpu.py --tune`) wins where it has these shapes; else the guesses below."""
    if interpret:  # the interpreter pays per program: wide tiles, but still exercise the split
        return 16, 32, 32, (2 if M <= DECODE_MAX_ROWS and K >= 64 else 1), 1, 1
    if dtype in DTYPES and (got := lookup("fp8_linear", DTYPES[dtype], M=M, N=N, K=K)) is not None:
        return (got["block_m"], got["block_n"], got["block_k"], got["split_k"], got["num_warps"], got["num_stages"])
    if M > DECODE_MAX_ROWS:
        return (64 if M <= 256 else 128), 128, 128, 1, 8, 3
    block_m = max(16, triton.next_power_of_2(M))
    block_n = 64
    programs = triton.cdiv(N, block_n)
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132
    # enough programs for ~2 waves over the SMs, each still reading at least 512 columns of K
    split = 1
    while programs * split * 2 <= 2 * sms and K // (split * 2) >= 512:
        split *= 2
    return block_m, block_n, 128, split, 4, 4


def fp8_linear_triton(x_MK: torch.Tensor, data_NK: torch.Tensor, scale_inv: torch.Tensor,
                      bias_N: torch.Tensor | None = None, block: tuple[int, int] = (128, 128),
                      config: tuple[int, int, int, int, int, int] | None = None, reduce: bool = True) -> torch.Tensor:
    """kernels.fp8_block.fp8_linear on 2-D x ([M, K]; the weight/scale pair checked there): [M, N] in x's dtype.
    `config` forces `tiles`' (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) (the tuner's sweep).
    reduce=False: where the reduction is split (and there is no bias), the float32 partial sums [M, SPLIT_K, N]
    (a view) instead, whose sum over dim 1 rounded to x's dtype is the output; else the output as usual."""
    M, K = x_MK.shape
    N = data_NK.shape[0]
    if K != data_NK.shape[1]:
        raise ValueError(f"x {tuple(x_MK.shape)} does not fit weight {tuple(data_NK.shape)}")
    if x_MK.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"fp8_linear_triton takes bfloat16, float16 or float32 activations, not {x_MK.dtype}")
    if M == 0:
        return x_MK.new_empty((0, N))
    interp = interpreting()
    x_MK = x_MK if x_MK.stride(1) == 1 else x_MK.contiguous()
    data_NK, scale_inv = data_NK.contiguous(), scale_inv.float().contiguous()
    bm, bn, bk, split, warps, stages = config or tiles(M, N, K, x_MK.device, interp, x_MK.dtype)
    while block[1] % bk:  # one scale column per step: a step must not straddle two scale blocks
        bk //= 2
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)
    out = torch.empty((split, M, N) if split > 1 else (M, N), device=x_MK.device,
                      dtype=torch.float32 if split > 1 else x_MK.dtype)
    bias = bias_N if bias_N is not None and split == 1 else None
    with launch("fp8_linear"):
        _fp8_linear_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), split)](
            x_MK, data_NK, scale_inv, bias if bias is not None else scale_inv, out, M, N, K, k_per_split,
            x_MK.stride(0), data_NK.stride(0), scale_inv.stride(0), out.stride(-2), out.stride(0) if split > 1 else 0,
            HAS_BIAS=bias is not None, SCALE_N=block[0], SCALE_K=block[1], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            F32_DOT=interp or x_MK.dtype == torch.float32, num_warps=warps, num_stages=stages)
    if split == 1:
        return out
    if not reduce and bias_N is None:
        return out.transpose(0, 1)
    summed = out.sum(0)
    if bias_N is not None:
        summed += bias_N.float()
    return summed.to(x_MK.dtype)
