"""Block FP8 weights (DeepSeek-V3 / Qwen3 "fp8" checkpoints): the format, a torch reference, the entry point.

A weight W [N, K] becomes `data` float8_e4m3fn [N, K] and `scale_inv` float32 [ceil(N/bn), ceil(K/bk)]
(bn = bk = 128 in every Qwen FP8 checkpoint): the block (i, j) of W covers rows i*bn.. and columns j*bk..
(the last ones partial), and W = data * scale_inv[i, j] there. The quantizer divides each block by
amax / 448 and rounds to nearest e4m3 (a block of zeros keeps scale 1), exactly as transformers'
FineGrainedFP8 quantizer does (tests/kernels/test_fp8_block.py checks it bit for bit), so a weight
quantized here equals one quantized by transformers or shipped by Qwen in the same format.

Why 128x128 blocks rather than one scale per output channel for `--quant-dense fp8`: the same format (and
so the same kernel) serves Qwen's own FP8 checkpoints, a block follows local magnitudes (a few outlier
input columns cost one block row, not a whole channel's precision), and its scales are 4 bytes per 16,384
weights. The cost is a rescale per 128 inputs in the kernel, which is free next to streaming the weight.

    fp8_linear(x [..., K], data [N, K], scale_inv, bias=None, block=(128, 128)) -> [..., N] in x's dtype

runs kernels/fp8_linear_triton.py (W8A16: e4m3 weights dequantised in registers, activations in
bf16/fp32, float32 accumulation) on a GPU or under TRITON_INTERPRET=1, and the torch reference
(dequantize, then F.linear) elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.backend import Backend, use_triton

E4M3_MAX = 448.0
BLOCK = (128, 128)


def scale_shape(shape: tuple[int, int] | torch.Size, block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The scale grid of an [N, K] weight: [ceil(N / bn), ceil(K / bk)]."""
    n, k = shape
    return -(-n // block[0]), -(-k // block[1])


def _padded(w_NK: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    gn, gk = scale_shape(w_NK.shape, block)
    return F.pad(w_NK, (0, gk * block[1] - w_NK.shape[1], 0, gn * block[0] - w_NK.shape[0]))


def quantize_block_fp8(w_NK: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (float) -> (data float8_e4m3fn [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)])."""
    if w_NK.dim() != 2 or not w_NK.is_floating_point() or w_NK.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"quantize_block_fp8 takes a 2-D float weight, not {w_NK.dtype} {tuple(w_NK.shape)}")
    n, k = w_NK.shape
    gn, gk = scale_shape(w_NK.shape, block)
    w = _padded(w_NK.float(), block).view(gn, block[0], gk, block[1])
    amax = w.abs().amax(dim=(1, 3))  # [gn, gk]
    # transformers: scale = 448 / amax (1 for an all-zero block), stored as its reciprocal
    scale = torch.where(amax > 0, E4M3_MAX / torch.where(amax > 0, amax, 1.0), 1.0)
    q = (w * scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(gn * block[0], gk * block[1])[:n, :k].contiguous(), (1.0 / scale).float()


def check_pair(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK, name: str = "weight") -> None:
    """Raise ValueError (naming `name`) unless `data` is e4m3 [N, K] and `scale_inv` a float [ceil(N/bn), ceil(K/bk)]."""
    if data.dtype != torch.float8_e4m3fn or data.dim() != 2:
        raise ValueError(f"{name}: block FP8 data must be a 2-D float8_e4m3fn tensor, not {data.dtype} "
                         f"{tuple(data.shape)}")
    want = scale_shape(data.shape, block)
    if tuple(scale_inv.shape) != want or not scale_inv.is_floating_point() or scale_inv.dtype.itemsize < 2:
        raise ValueError(f"{name}_scale_inv: expected a float32 tensor of shape {list(want)} for weight "
                         f"{list(data.shape)} in {block[0]}x{block[1]} blocks, got {scale_inv.dtype} "
                         f"{list(scale_inv.shape)}")


def dequantize_block_fp8(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                         block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """(data [N, K], scale_inv) -> W [N, K] in `dtype` (multiplied in float32, rounded once)."""
    check_pair(data, scale_inv, block)
    n, k = data.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (data.float() * s).to(dtype)


def fp8_linear_reference(x: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """x @ W.T (+ bias) with W dequantized to float32, summed in float32, rounded to x's dtype (float64 x: in
    float64)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_block_fp8(data, scale_inv, acc, block)
    out = F.linear(x.to(acc), w, None if bias is None else bias.to(acc))
    return out.to(x.dtype)


def fp8_linear(x: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
               block: tuple[int, int] = BLOCK, backend: Backend = "auto", reduce: bool = True) -> torch.Tensor:
    """x [..., K] @ W.T for a block-FP8 W [N, K]: [..., N] in x's dtype. See the module docstring.
    reduce=False, 2-D x: the Triton kernel's float32 split-K partials [M, S, N] where it splits the reduction
    (kernels/fused.py's add_rms_norm adds them); the output [M, N] otherwise."""
    check_pair(data, scale_inv, block)
    if x.shape[-1] != data.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(data.shape)}")
    if x.dtype != torch.float64 and use_triton(x.device, backend):
        from kernels.fp8_linear_triton import fp8_linear_triton

        lead = x.shape[:-1]
        out = fp8_linear_triton(x.reshape(-1, x.shape[-1]), data, scale_inv, bias, block,
                                reduce=reduce or x.dim() != 2)
        return out if out.dim() == 3 and x.dim() == 2 else out.view(*lead, data.shape[0])
    return fp8_linear_reference(x, data, scale_inv, bias, block)


def mxfp8_reencode_error(w: torch.Tensor) -> float:
    """Relative RMS error of re-encoding the values `w` (float) as MXFP8 (kernels/mxfp8.py, 32-element E8M0
    blocks along the last dim): ||MX(w) - w|| / ||w||. Block FP8 -> MXFP8 is not lossless (the E8M0 scale is
    a power of two, the block-FP8 one is not), so the loader reports this number."""
    from kernels.mxfp8 import dequantize_mxfp8_reference, quantize_mxfp8_reference

    w32 = w.float()
    back = dequantize_mxfp8_reference(*quantize_mxfp8_reference(w32), torch.float32)
    return float((back - w32).norm() / w32.norm().clamp(min=1e-30))
