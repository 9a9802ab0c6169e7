"""CPU fast path for inference: weights reordered once into oneDNN's blocked layout.

On a CPU, torch's plain matmul (MKL sgemm) reads a weight at a third of memory bandwidth when the
batch has a handful of rows, which is exactly a decode step of a few sequences. oneDNN with the
weight reordered once at load time reads it near bandwidth at those sizes and matches sgemm on large
batches (x [8, 768] @ W [12288, 768]^T: 2.6 ms plain, 1.4 ms packed; [1024, 768]: the same). The
packed weight replaces the plain one, so packing costs no memory.

    pack(w [N, K])            -> an opaque packed weight (inference only: no autograd)
    packed_linear(x [M, K], packed, bias=None) -> [M, N], like F.linear(x, w, bias)
    PackedLinear(linear)      -> a drop-in for nn.Linear in inference

`available(dtype)` says whether this torch build can do it for that dtype (oneDNN present; float32,
or bfloat16 on CPUs with native bf16 support).
"""

from __future__ import annotations

import torch
from torch import nn


def available(dtype: torch.dtype) -> bool:
    try:  # private ops (the ones torch.compile's CPU freezing uses): absent from some builds
        if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            return False
        if dtype == torch.float32:
            return True
        return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack(w_NK: torch.Tensor) -> torch.Tensor:
    if w_NK.dim() != 2 or w_NK.device.type != "cpu":
        raise ValueError(f"pack takes a 2-D CPU weight, got {tuple(w_NK.shape)} on {w_NK.device}")
    return torch.ops.mkldnn._reorder_linear_weight(w_NK.detach().contiguous(), None)


def packed_linear(x_MK: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x_MK.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """nn.Linear's forward on a packed weight. `stored_bytes` is what the weight takes as stored."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack(w)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.stored_bytes = w.numel() * w.element_size() + (0 if self.bias is None else self.bias.nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = packed_linear(x.reshape(-1, self.in_features), self.packed, self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def min_packed_elements() -> int:
    """The smallest weight (elements) worth packing on this CPU, measured against torch's plain matmul
    (MKL's sgemm) on two 2-core AMD EPYC VMs, plain / packed:
    - AVX2: oneDNN costs ~20 us more per call, so a small weight, or any weight with a single row, is
      faster plain. From 1 M elements up, packed wins from 4 rows on ([2048, 2048]: 8 rows 1.2 -> 0.6 ms)
      and loses ~50 us with one row.
    - AVX-512 (Zen 5): MKL runs its AVX2 code on AMD CPUs, oneDNN its AVX-512 code, so packed wins at
      every size from [512, 512] up: [1280, 768] 1 row 53 -> 37 us, 32 rows 380 -> 148 us, 4096 rows
      (a prefill) 38 -> 17 ms; [512, 512] 1 row 15 -> 17 us, 32 rows 111 -> 49 us. A router ([16, 768])
      stays plain: 2 -> 12 us a decode step."""
    try:
        avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    except (AttributeError, RuntimeError):
        avx512 = False
    return 1 << 18 if avx512 else 1 << 20


MIN_PACKED_ELEMENTS = min_packed_elements()


def pack_linears(module: nn.Module, min_elements: int = MIN_PACKED_ELEMENTS) -> int:
    """Replace every nn.Linear under `module` whose weight has at least `min_elements` elements by a
    PackedLinear; returns how many were replaced."""
    n = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.numel() >= min_elements:
                setattr(parent, name, PackedLinear(child))
                n += 1
    return n
