"""MXFP8 formats and Triton kernels, with their torch references.

The seam the native engine (serve/model) and the trainer call for a Qwen3-MoE expert layer:

    moe_forward(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, *, backend="auto", mma="auto") -> out_TD

    x_TD [T, D] bf16; topk_ids_TK [T, K] int; topk_weights_TK [T, K] float;
    w13 = gate_up_proj [E, 2I, D] (rows [gate; up]), w2 = down_proj [E, D, I];
    both plain tensors (torch reference, differentiable) or both MXFP8Tensor (fused Triton kernels on a
    GPU; on a CPU the reference on dequantized weights, or the kernels under TRITON_INTERPRET=1).
    Returns sum_k topk_weights[t, k] * w2[e] @ (silu(gate_e x_t) * up_e x_t), [T, D] in x's dtype.
    Full contract: kernels/moe.py.

Loading weights: `MXFP8Tensor.quantize(w)` (or `MXFP8Tensor(data, scales)` from a checkpoint that stores
them). Training in the served precision: `mxfp8_moe(...)` (same arguments, master weights) and
`MXFP8Linear` / `mxfp8_linear`. Format: `quantize_mxfp8(x, block_size=32, scale_mode="rceil")` ->
(data float8_e4m3fn, scales float8_e8m0fnu [..., K // 32]) and `dequantize_mxfp8(data, scales, dtype)`.

Importing this package needs torch only; triton is imported when a kernel first runs (kernels/backend.py
has the rule for when that is).
"""

from kernels.backend import use_triton, why_not_triton
from kernels.moe import moe_forward
from kernels.moe_align import AlignedPairs, moe_align_block_size
from kernels.moe_reference import moe_reference, moe_reference_dense
from kernels.mxfp8 import MXFP8Tensor, dequantize_mxfp8, quantize_mxfp8
from kernels.mxfp8_linear import MXFP8Linear, fake_quantize_mxfp8, mxfp8_linear, mxfp8_moe

__all__ = [
    "AlignedPairs",
    "MXFP8Linear",
    "MXFP8Tensor",
    "dequantize_mxfp8",
    "fake_quantize_mxfp8",
    "moe_align_block_size",
    "moe_forward",
    "moe_reference",
    "moe_reference_dense",
    "mxfp8_linear",
    "mxfp8_moe",
    "quantize_mxfp8",
    "use_triton",
    "why_not_triton",
]
