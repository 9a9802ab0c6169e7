"""MXFP8 (OCP Microscaling v1.0): the format, a bit-level torch reference, and the public entry points.

A tensor `x` of shape [..., K] becomes `data` (float8_e4m3fn, same shape) and `scales` (E8M0: one biased
power-of-two exponent per 32 consecutive elements of the last dim, shape [..., K // 32]); the value of an
element is `data * 2**(scale - 127)`. Scale byte 255 means NaN.

Scale rules (`scale_mode`), both computed from float32 bits, never from log2:
- "rceil" (cuBLAS / TransformerEngine / torchao RCEIL): scale = 2**ceil(log2(amax / 448)), the quotient
  rounded once to float32 and its ceiling read from its exponent and mantissa bits. Never saturates.
- "floor" (OCP minimal, torchao's default): scale = 2**(floor(log2 amax) - 8); elements above 448 after
  scaling saturate to +-448.
Elements are rounded to nearest-even after clamping to +-448.

Matching torchao 0.18 `to_mx` (its eager path) bit for bit, quirks included, so that weights quantized
here and there are interchangeable:
- rceil: a block whose scale byte is 0 (amax <= 448 * 2**-127) is scaled by 1, so its data is all zeros.
- floor: the scale used to divide is clamped to the smallest normal float32, 2**-126, while the byte
  stored may be 0 (= 2**-127 on dequantization), as torchao does.
- Known difference (deliberate): torchao's eager rceil takes `ceil(torch.log2(q))` in float32, which for
  a quotient q a few ulps above a power of two (|log2 q| >= 4) rounds to the integer below and so picks a
  scale half as large, saturating the block's largest element. We take the exact ceiling from the bits,
  as the hardware instruction (`cvt.rp.satfinite.ue8m0x2.f32`) and torchao's own compiled sm_100 path
  do. For continuous data this touches about one block in two million; the test suite pins it.

Non-finite input: NaN anywhere in a block gives scale byte 255 (and rceil makes the whole block NaN, as
torchao does); an infinite amax gives byte 254 (rceil) or a saturated block (floor). Dequantization turns
byte 255 into NaN, so NaN propagates.

Dequantization multiplies in float32 and rounds once to the target dtype; for bfloat16 and float32 that
is bit-identical to torchao's `to_dtype` (for float16 torchao first casts the scale to float16, where
large scales overflow; we do not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from kernels.backend import Backend, use_triton

BLOCK_SIZE = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
ScaleMode = Literal["rceil", "floor"]
SCALE_MODES = ("rceil", "floor")


@dataclass(frozen=True)
class MXFP8Tensor:
    """A plain pair (not a tensor subclass): `data` float8_e4m3fn [..., K], `scales` E8M0 [..., K // 32].

    Expert weights use it as data [E, N, K] + scales [E, N, K // 32], K being the reduction dim.
    """

    data: torch.Tensor
    scales: torch.Tensor
    dense: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """Optional: these values dequantized once (`with_dense`), which the torch reference paths read instead
    of dequantizing per call: a CPU serving float64 would otherwise spend half a decode step there."""
    narrow: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """With a float64 `dense`: the same values in bfloat16, which holds every MXFP8 value exactly (4-bit
    significands; float32 where a tiny scale puts values below bfloat16's subnormals), for the float64 CPU
    expert kernel, which widens them as it reads: a quarter of the bytes a step streams per expert, the
    same sums."""

    def __post_init__(self):
        _check_pair(self.data, self.scales, BLOCK_SIZE)

    @classmethod
    def quantize(cls, x: torch.Tensor, scale_mode: ScaleMode = "rceil", backend: Backend = "auto"):
        return cls(*quantize_mxfp8(x, scale_mode=scale_mode, backend=backend))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, backend: Backend = "auto") -> torch.Tensor:
        return dequantize_mxfp8(self.data, self.scales, dtype=dtype, backend=backend)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def with_dense(self, dtype: torch.dtype) -> MXFP8Tensor:
        """The same values, also held dequantized in `dtype` (exactly the reference dequantization); for
        float64, also `narrow`."""
        dense = dequantize_mxfp8_reference(self.data, self.scales, dtype)
        narrow = None
        if dtype == torch.float64:
            narrow = dense.to(torch.bfloat16)
            if not torch.equal(narrow.to(dtype), dense):
                narrow = dense.float()  # exact: float64 dequantization widens float32 values
        return MXFP8Tensor(self.data, self.scales, dense, narrow)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


def quantize_mxfp8(x: torch.Tensor, block_size: int = BLOCK_SIZE, scale_mode: ScaleMode = "rceil",
                   backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (float32/bfloat16/float16; float64 masters are rounded to float32 first) -> (data
    float8_e4m3fn [..., K], scales float8_e8m0fnu [..., K // block_size]). Blocks run along the last dim.
    See the module docstring for the rules."""
    if x.dtype == torch.float64:
        x = x.float()
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"quantize_mxfp8 takes float32, bfloat16 or float16, not {x.dtype}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, not {scale_mode!r}")
    if x.dim() == 0 or x.shape[-1] % block_size != 0:
        raise ValueError(f"the last dim of {tuple(x.shape)} must be a multiple of block_size={block_size}")
    if block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 2, not {block_size}")
    if use_triton(x.device, backend):
        from kernels.mxfp8_triton import quantize_mxfp8_triton
        return quantize_mxfp8_triton(x, block_size, scale_mode)
    return quantize_mxfp8_reference(x, block_size, scale_mode)


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     backend: Backend = "auto") -> torch.Tensor:
    """(data float8_e4m3fn [..., K], scales E8M0 or uint8 [..., K // b]) -> [..., K] in `dtype` (float64:
    the float32 values widened, exactly)."""
    block_size = _check_pair(data, scales)
    if dtype == torch.float64:
        return dequantize_mxfp8(data, scales, torch.float32, backend).to(torch.float64)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dequantize_mxfp8 returns float32, bfloat16 or float16, not {dtype}")
    if use_triton(data.device, backend):
        from kernels.mxfp8_triton import dequantize_mxfp8_triton
        return dequantize_mxfp8_triton(data, scales, dtype, block_size)
    return dequantize_mxfp8_reference(data, scales, dtype)


def _check_pair(data: torch.Tensor, scales: torch.Tensor, block_size: int | None = None) -> int:
    """Validates a (data, scales) pair and returns its block size."""
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"MXFP8 data must be float8_e4m3fn, not {data.dtype}")
    if scales.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"MXFP8 scales must be float8_e8m0fnu or uint8, not {scales.dtype}")
    if data.dim() == 0 or scales.shape[:-1] != data.shape[:-1] or scales.shape[-1] == 0 \
            or data.shape[-1] % scales.shape[-1] != 0:
        raise ValueError(f"scales {tuple(scales.shape)} do not fit data {tuple(data.shape)}")
    found = data.shape[-1] // scales.shape[-1]
    if block_size is not None and found != block_size:
        raise ValueError(f"data {tuple(data.shape)} with scales {tuple(scales.shape)}: block {found}, "
                         f"expected {block_size}")
    if data.device != scales.device:
        raise ValueError(f"data on {data.device}, scales on {scales.device}")
    return found


# ---------------------------------------------------------------- torch reference (bit-level)

def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 powers of two: byte 0 is 2**-127 (a subnormal), byte 255 is NaN."""
    b = scales.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)
    bits = torch.where(b == E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def scale_exponent(amax: torch.Tensor, scale_mode: ScaleMode) -> torch.Tensor:
    """amax (float32, NaN-propagating) -> biased E8M0 exponent as int32 in [0, 255]."""
    if scale_mode == "rceil":
        q = amax / E4M3_MAX  # one IEEE division: the quotient whose bits decide the scale
        qb = q.view(torch.int32)
        exp, man = (qb >> 23) & 0xFF, qb & 0x7FFFFF
        # A subnormal quotient above 2**-127 still rounds up to 2**-126 (byte 1).
        biased = torch.where(exp == 0, (man > 0x400000).to(torch.int32), exp + (man != 0).to(torch.int32))
        biased = torch.where(torch.isinf(amax), 254, biased)
    else:
        biased = (((amax.view(torch.int32) >> 23) & 0xFF) - 8).clamp(min=0)
    return torch.where(torch.isnan(amax), E8M0_NAN, biased)


def scale_multiplier(biased: torch.Tensor, scale_mode: ScaleMode) -> torch.Tensor:
    """The float32 factor each element is multiplied by before rounding: 1 / scale, built from bits
    (exact), with torchao's conventions at the edges (see the module docstring)."""
    if scale_mode == "rceil":
        r = ((254 - biased).clamp(min=0) << 23).view(torch.float32)
        r = torch.where(biased == 0, 1.0, r)
        r = torch.where(biased == 254, 2.0 ** -127, r)
        return torch.where(biased == E8M0_NAN, float("nan"), r)
    # floor: torchao divides by max(scale, 2**-126); a NaN block's scale is +inf, so the factor is 0.
    b = biased.clamp(min=1)
    r = ((254 - b).clamp(min=0) << 23).view(torch.float32)
    return torch.where(biased == E8M0_NAN, 0.0, r)


def quantize_mxfp8_reference(x: torch.Tensor, block_size: int = BLOCK_SIZE,
                             scale_mode: ScaleMode = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    shape = x.shape
    x_GB = x.reshape(-1, block_size).to(torch.float32)  # G blocks of B elements
    amax_G1 = torch.amax(x_GB.abs(), dim=1, keepdim=True)
    biased_G1 = scale_exponent(amax_G1, scale_mode)
    y_GB = x_GB * scale_multiplier(biased_G1, scale_mode)
    y_GB = torch.clamp(y_GB, -E4M3_MAX, E4M3_MAX)  # clamp keeps NaN
    data = y_GB.to(torch.float8_e4m3fn).reshape(shape)
    scales = biased_G1.to(torch.uint8).view(torch.float8_e8m0fnu).reshape(*shape[:-1], -1)
    return data, scales


def dequantize_mxfp8_reference(data: torch.Tensor, scales: torch.Tensor,
                               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    block = data.shape[-1] // scales.shape[-1]
    d_GB = data.reshape(-1, block).to(torch.float32)
    s_G1 = e8m0_to_float32(scales.reshape(-1, 1))
    return (d_GB * s_G1).to(dtype).reshape(data.shape)
