"""Fused MoE forward with MXFP8 expert weights, in Triton: two grouped GEMM kernels over expert-sorted
blocks of (token, slot) pairs.

Approach (vLLM's fused_moe shape, our kernels):
1. `moe_align_block_size` sorts the T*K pairs by expert and pads every expert's run to BLOCK_M, so each
   block of BLOCK_M rows has one expert. Experts nobody picked have no block: their bytes are never read.
2. `_gate_up_kernel`: program (block, n-tile) gathers its rows of x, streams the expert's gate rows n and
   up rows I + n of w13 [E, 2I, D] (fp8 + E8M0 scales) over D, and writes silu(gate) * up into h, a
   [P_padded, I] buffer in sorted order.
3. `_down_kernel`: program (block, n-tile) reads its h rows (contiguous: already sorted), streams w2
   [E, D, I], multiplies by the pair's router weight and writes the pair's row of a [T*K, D] float32
   buffer; a torch sum over K finishes the combine (deterministic, unlike atomics).

Matrix multiply, per GPU generation (`mma`):
- "dequant" (Hopper sm_90 has no MX instruction): weights are dequantized in registers (fp8 -> float32
  times the block's power of two -> bf16) and fed to a bf16 `tl.dot` with float32 accumulation; MXFP8
  saves bandwidth here, not FLOPs. Under the interpreter the dot runs in float32 (it has no bf16 math).
- "dot_scaled" (sm_100+): activations are quantized to MXFP8 in registers (rceil, blocks of 32 along the
  reduction dim) and both operands go to `tl.dot_scaled(..., "e4m3", ..., "e4m3")`, the native
  block-scaled MMA. Numerically that is the reference with `act_mxfp8=True`.

Up to DECODE_MAX_TOKENS tokens with the "dequant" multiply, kernels/moe_decode_triton.py's GEMV-shaped
kernels run instead (no alignment; each active expert's programs serve all of its tokens). Above that,
the tile choice aims to read each active expert's bytes once:
BLOCK_M is the next power of two >= T (min 16, for tl.dot), and since a token picks an expert at most once,
no expert then spans two blocks; small BLOCK_N gives the grid enough programs to fill the GPU.

Tiles: on a GPU the grouped kernels' BLOCK_N, BLOCK_K, warps and stages are autotuned per token bucket
(GATE_UP_CONFIGS, DOWN_CONFIGS; COMPOSER_MOE_AUTOTUNE=0 takes `choose_tiles`' fixed guesses); BLOCK_M
follows the token count, since the alignment pads to it.

Limits: D and I must be multiples of 32 (the scale blocks); the candidate tiles are guesses that no GPU
has timed yet (`bench/kernels.py` is where to see them); GPU code paths are not yet run on a GPU (see
bench/KERNELS-RESULTS.md); under the interpreter the intermediate h is float32, not x's dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.backend import interpreting
from kernels.launches import launch
from kernels.moe_align import moe_align_block_size
from kernels.moe_decode_triton import DECODE_MAX_TOKENS, fused_moe_mxfp8_decode
from kernels.moe_decode_variants import moe_decode_variant, tuned_choice
from kernels.mxfp8 import MXFP8Tensor
from kernels.mxfp8_triton import mx_rows_matmul, mx_swiglu_rows

# ---------------------------------------------------------------- jit helpers


# ---------------------------------------------------------------- kernels


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                    num_pairs, D, INTER, token_bucket,
                    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_SCALED: tl.constexpr, F32_DOT: tl.constexpr,
                    EXACT_CAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the last real block: the grid is sized for the worst case to avoid a host sync
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    row_M = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_M = tl.load(sorted_ptr + row_M)
    ok_M = pair_M < num_pairs  # padding rows hold num_pairs
    token_M = (pair_M // TOP_K).to(tl.int64)
    n_N = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok_N = n_N < INTER
    h_MN = mx_swiglu_rows(x_ptr, token_M, ok_M, stride_xt, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
                          n_N, ok_N, D, INTER, stride_wn, stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_SCALED, F32_DOT,
                          EXACT_CAST)
    tl.store(h_ptr + row_M[:, None] * stride_hm + n_N[None, :], h_MN.to(h_ptr.dtype.element_ty),
             mask=ok_M[:, None] & ok_N[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, out_ptr, topk_weight_ptr, sorted_ptr, block_expert_ptr,
                 num_padded_ptr, num_pairs, D, INTER, token_bucket,
                 stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_op,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_SCALED: tl.constexpr, F32_DOT: tl.constexpr, EXACT_CAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    row_M = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_M = tl.load(sorted_ptr + row_M)
    ok_M = pair_M < num_pairs
    n_N = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok_N = n_N < D
    acc = mx_rows_matmul(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), h_ptr, row_M.to(tl.int64), ok_M, stride_hm,
                         w_ptr + expert * stride_we, s_ptr + expert * stride_se, n_N, ok_N, INTER, stride_wn,
                         stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_SCALED, F32_DOT, EXACT_CAST)
    weight_M = tl.load(topk_weight_ptr + pair_M, mask=ok_M, other=0.0).to(tl.float32)
    acc = acc * weight_M[:, None]
    tl.store(out_ptr + pair_M[:, None].to(tl.int64) * stride_op + n_N[None, :], acc,
             mask=ok_M[:, None] & ok_N[None, :])


# ---------------------------------------------------------------- tiles and wrapper


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch shape. BLOCK_N tiles the output features, BLOCK_K the reduction."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoETiles:
    block_m: int
    gate_up: Tiles
    down: Tiles


def choose_tiles(num_tokens: int, interpret: bool | None = None) -> MoETiles:
    """First guesses, not tuned on hardware; sized so that per-stage shared memory stays well under
    Hopper's 228 KiB and the dequantized weight tiles fit in registers. The interpreter pays per
    program, so it gets the fewest, largest tiles that the small test shapes allow."""
    if interpret if interpret is not None else interpreting():
        return MoETiles(16, Tiles(32, 64), Tiles(32, 64))
    if num_tokens <= 64:  # decode: one block per active expert, many narrow programs to fill the SMs
        block_m = max(16, triton.next_power_of_2(num_tokens))
        return MoETiles(block_m, Tiles(32, 128, 4, 4), Tiles(32, 128, 4, 4))
    return MoETiles(64, Tiles(64, 64, 8, 3), Tiles(128, 64, 8, 3))


def _configs(shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st) for n, k, w, st in shapes]


# Candidates for sm_90 (BLOCK_N, BLOCK_K, warps, stages): per-stage shared memory well under 228 KiB, the
# dequantized float32 weight tile within registers. The autotuner times them on the GPU at hand, once per
# (token bucket, D, I, dtypes), and keeps the fastest; on a CUDA graph the capture's warm-up runs first.
GATE_UP_CONFIGS = _configs([(32, 128, 4, 4), (64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3)])
DOWN_CONFIGS = _configs([(32, 128, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3)])
_gate_up_tuned = triton.autotune(GATE_UP_CONFIGS, key=["token_bucket", "D", "INTER"])(_gate_up_kernel)
_down_tuned = triton.autotune(DOWN_CONFIGS, key=["token_bucket", "D", "INTER"])(_down_kernel)


def token_bucket(num_tokens: int) -> int:
    """The autotuner's key for a token count: powers of two from 32 to 8192 (one measurement each)."""
    return min(8192, max(32, triton.next_power_of_2(num_tokens)))


def autotuning(device: torch.device, explicit_tiles: bool) -> bool:
    """Autotune the grouped kernels' tiles on a GPU unless tiles were given, the interpreter runs (it has
    no timer worth the name) or COMPOSER_MOE_AUTOTUNE=0 asks for the fixed `choose_tiles`."""
    return (device.type == "cuda" and not explicit_tiles and not interpreting()
            and os.environ.get("COMPOSER_MOE_AUTOTUNE", "1") != "0")


def default_mma(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10:
        return "dot_scaled"
    return "dequant"


def fused_moe_mxfp8(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    w13: MXFP8Tensor, w2: MXFP8Tensor, mma: str = "auto",
                    tiles: MoETiles | None = None, autotune: bool | None = None, reduce: bool = True) -> torch.Tensor:
    """The kernel path of kernels.moe.moe_forward (which checks the arguments); see the module docstring.
    `tiles` forces the launch shapes; `autotune` (None: `autotuning`'s rule) measures them instead.
    reduce=False: the weighted float32 per-pair rows [T, K, D], not yet summed over K."""
    explicit_tiles = tiles is not None
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    E, two_i, _ = w13.shape
    inter = two_i // 2
    if T == 0:
        return x_TD.new_zeros((0, D)) if reduce else x_TD.new_zeros((0, K, D), dtype=torch.float32)
    mma = default_mma(x_TD.device) if mma == "auto" else mma
    if mma not in ("dequant", "dot_scaled"):
        raise ValueError(f"mma must be 'auto', 'dequant' or 'dot_scaled', not {mma!r}")
    if mma == "dequant" and tiles is None and (choice := tuned_choice(x_TD, topk_ids_TK, w13, w2)) is not None:
        # this GPU's tuned table (kernels/tuning.py) picked a decode variant, or the grouped kernels, for this shape
        if choice != "grouped":
            return moe_decode_variant(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, choice, reduce)
        if T <= DECODE_MAX_TOKENS:
            tiles = choose_tiles(T)  # the sorted grouped path below instead of the decode kernels
    if T <= DECODE_MAX_TOKENS and mma == "dequant" and tiles is None:  # few tokens: GEMV-shaped, no sort
        return fused_moe_mxfp8_decode(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, reduce)
    tiles = tiles or choose_tiles(T)
    x_TD = x_TD.contiguous()
    w13_data, w13_scales = w13.data.contiguous(), w13.scales.contiguous().view(torch.uint8)
    w2_data, w2_scales = w2.data.contiguous(), w2.scales.contiguous().view(torch.uint8)
    weights_P = topk_weights_TK.contiguous().reshape(-1)
    aligned = moe_align_block_size(topk_ids_TK, tiles.block_m, E)
    n_blocks = aligned.block_expert.numel()
    # h is kept in x's dtype (bf16 on a GPU, as a bf16 model rounds it); under the interpreter in float32,
    # because its float32 -> bf16 cast truncates instead of rounding.
    h_dtype = torch.float32 if interpreting() else x_TD.dtype
    h = torch.empty((aligned.sorted_pair_ids.numel(), inter), dtype=h_dtype, device=x_TD.device)
    out_PD = torch.empty((T * K, D), dtype=torch.float32, device=x_TD.device)
    common = dict(DOT_SCALED=mma == "dot_scaled", F32_DOT=interpreting(), EXACT_CAST=interpreting())

    gate_up_args = (x_TD, w13_data, w13_scales, h, aligned.sorted_pair_ids, aligned.block_expert,
                    aligned.num_padded, T * K, D, inter, token_bucket(T),
                    x_TD.stride(0), w13_data.stride(0), w13_data.stride(1), w13_scales.stride(0),
                    w13_scales.stride(1), h.stride(0))
    down_args = (h, w2_data, w2_scales, out_PD, weights_P, aligned.sorted_pair_ids, aligned.block_expert,
                 aligned.num_padded, T * K, D, inter, token_bucket(T),
                 h.stride(0), w2_data.stride(0), w2_data.stride(1), w2_scales.stride(0), w2_scales.stride(1),
                 out_PD.stride(0))
    if autotune if autotune is not None else autotuning(x_TD.device, explicit_tiles):
        # BLOCK_N, BLOCK_K, warps and stages measured on this GPU at the first call of each token bucket
        with launch("moe_gate_up"):
            _gate_up_tuned[lambda meta: (n_blocks, triton.cdiv(inter, meta["BLOCK_N"]))](
                *gate_up_args, TOP_K=K, BLOCK_M=tiles.block_m, **common)
        with launch("moe_down"):
            _down_tuned[lambda meta: (n_blocks, triton.cdiv(D, meta["BLOCK_N"]))](
                *down_args, BLOCK_M=tiles.block_m, **common)
    else:
        gu, dn = tiles.gate_up, tiles.down
        with launch("moe_gate_up"):
            _gate_up_kernel[(n_blocks, triton.cdiv(inter, gu.block_n))](
                *gate_up_args, TOP_K=K, BLOCK_M=tiles.block_m, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
                num_warps=gu.num_warps, num_stages=gu.num_stages, **common)
        with launch("moe_down"):
            _down_kernel[(n_blocks, triton.cdiv(D, dn.block_n))](
                *down_args, BLOCK_M=tiles.block_m, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k,
                num_warps=dn.num_warps, num_stages=dn.num_stages, **common)
    return out_PD.view(T, K, D).sum(dim=1).to(x_TD.dtype) if reduce else out_PD.view(T, K, D)
