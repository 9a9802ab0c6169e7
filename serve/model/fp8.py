"""FP8 dense layers: a Linear-like module on block-FP8 weights, swapped into the model (no fork of it).

`FP8Linear` holds `weight` float8_e4m3fn [N, K] and `weight_scale_inv` float32 [ceil(N/128), ceil(K/128)]
(kernels/fp8_block.py) and runs kernels.fp8_block.fp8_linear: the Triton W8A16 kernel on a GPU (decode rows
and prefill tiles, no host sync, so the captured decode step takes it as is), the torch reference elsewhere.

`quantize_dense(model, keep_fp8)` is `--quant-dense fp8`: the attention projections (q/k/v fused first, as
every inference path fuses them) and the LM head become block FP8. With `keep_fp8` (a GPU) they are swapped
for FP8Linear, half the bytes a decode step reads for them. Without (a CPU) each weight is rounded to its FP8
values and kept as a plain nn.Linear in the model's dtype: the same numbers, so a CPU measures the logit gap
a GPU would serve, but no memory saved; the CPU's packed weights and C++ decode step take it unchanged.
The router and the norms stay as they are (Qwen's own FP8 releases leave them unconverted too); a tied LM
head (the embedding matrix) is left alone.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_block import BLOCK, check_pair, dequantize_block_fp8, fp8_linear, quantize_block_fp8

MODES = ("none", "fp8")


class FP8Linear(nn.Module):
    """nn.Linear's forward on a block-FP8 weight (inference only: the Parameters do not train)."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                 block: tuple[int, int] = BLOCK):
        super().__init__()
        check_pair(weight, weight_scale_inv, block)
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(weight_scale_inv.float(), requires_grad=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, block: tuple[int, int] = BLOCK) -> FP8Linear:
        data, scale_inv = quantize_block_fp8(linear.weight.detach(), block)
        return cls(data, scale_inv, linear.bias, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, self.block)

    def parts(self, x_MK: torch.Tensor) -> torch.Tensor:
        """forward, or (the Triton kernel with its reduction split, at decode rows) its float32 partial sums
        [M, S, N] for the next add_rms_norm to add: the decode step's o projection, two kernels fewer."""
        return fp8_linear(x_MK, self.weight, self.weight_scale_inv, self.bias, self.block, reduce=False)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_block_fp8(self.weight, self.weight_scale_inv, dtype, self.block)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block={self.block}")


def cat_rows(parts: list[FP8Linear]) -> FP8Linear:
    """One FP8Linear computing the parts' outputs side by side (q, k, v -> qkv). Exact when every part but the
    last has a multiple of the block's rows (Qwen3-30B: 4,096 + 512 + 512); otherwise the parts' values are
    re-quantized as one matrix (one more rounding: only tiny test models have such shapes)."""
    block = parts[0].block
    if any(p.block != block or p.in_features != parts[0].in_features for p in parts):
        raise ValueError("cat_rows: parts differ in block or input size")
    biases = [p.bias for p in parts]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else p.weight.new_zeros(p.out_features, dtype=torch.float32)
         for b, p in zip(biases, parts, strict=True)])
    if all(p.out_features % block[0] == 0 for p in parts[:-1]):
        return FP8Linear(torch.cat([p.weight.detach() for p in parts]),
                         torch.cat([p.weight_scale_inv.detach() for p in parts]), bias, block)
    w = torch.cat([p.dequantize(torch.float32) for p in parts])
    return FP8Linear(*quantize_block_fp8(w, block), bias, block)


def fuse_qkv(attn: nn.Module) -> None:
    """Attention.fuse_qkv for FP8Linear q/k/v (that one concatenates plain weights and would drop the scales)."""
    if getattr(attn, "qkv_proj", None) is not None:
        return
    attn.qkv_proj = cat_rows([attn.q_proj, attn.k_proj, attn.v_proj])
    del attn.q_proj, attn.k_proj, attn.v_proj


def _targets(model: nn.Module) -> list[tuple[nn.Module, str]]:
    out = []
    for layer in model.layers:
        attn = layer.self_attn
        if attn.qkv_proj is None:
            fuse_qkv(attn) if isinstance(attn.q_proj, FP8Linear) else attn.fuse_qkv()
        out += [(attn, "qkv_proj"), (attn, "o_proj")]
    if model.lm_head is not None:
        out.append((model, "lm_head"))
    return out


@torch.no_grad()
def quantize_dense(model: nn.Module, keep_fp8: bool, block: tuple[int, int] = BLOCK) -> tuple[int, float]:
    """`--quant-dense fp8` (see the module docstring). Returns (layers converted, the largest relative RMS
    error ||W_fp8 - W|| / ||W|| among them). Layers already FP8 (a block-FP8 checkpoint's) stay as loaded."""
    n, worst = 0, 0.0
    for parent, name in _targets(model):
        m = getattr(parent, name)
        if isinstance(m, FP8Linear) or type(m) is not nn.Linear:
            continue
        w = m.weight.detach()
        data, scale_inv = quantize_block_fp8(w, block)
        back = dequantize_block_fp8(data, scale_inv, torch.float32, block)
        worst = max(worst, float((back - w.float()).norm() / w.float().norm().clamp(min=1e-30)))
        if keep_fp8:
            setattr(parent, name, FP8Linear(data, scale_inv, m.bias, block))
        else:
            m.weight.copy_(back.to(w.dtype))
        n += 1
    return n, worst


def dense_fp8_bytes(model: nn.Module) -> int:
    """Bytes of the FP8Linear weights and scales in `model`."""
    return sum(m.weight.numel() + m.weight_scale_inv.numel() * 4 for m in model.modules() if isinstance(m, FP8Linear))


def describe_checkpoint(model: nn.Module) -> str:
    """For the engine's start-up line: what loading a block-FP8 checkpoint did ("" for any other)."""
    r = getattr(model, "fp8_report", None)
    if not r:
        return ""
    dense = f"{r['dense_fp8_layers']} dense layers kept in FP8" if r["dense_fp8_layers"] else "dense layers dequantized"
    err = r["mxfp8_reencode_rel_rms_max"]
    return (f"; block-FP8 checkpoint ({r['block'][0]}x{r['block'][1]}): {dense}, experts {r['experts']}"
            + (f", re-encoding error {err:.4f} (relative RMS, worst layer)" if err is not None else ""))
