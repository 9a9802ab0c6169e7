"""Triton MXFP8 quantizer and dequantizer, plus the @triton.jit helpers the MoE kernels share.

Approach: a contiguous [..., K] tensor with K % 32 == 0 is, flattened, a list of G = numel / 32 blocks
of 32 consecutive elements, and its scales flattened are one byte per block in the same order. So each
program takes BLOCK_G whole blocks ([BLOCK_G, 32] tile, one contiguous span of memory), reduces amax
along the 32, derives the E8M0 exponent from float32 bits exactly as `kernels.mxfp8` does, scales and
rounds. It reads the input once and writes 1 + 1/32 bytes per element: bandwidth-bound by design.

Rounding to e4m3: on a GPU the hardware conversion (`cvt.rn.satfinite`) rounds to nearest-even. The
Triton interpreter's float32 -> fp8 conversion does not (it rounds half up and can carry into the wrong
exponent), so under the interpreter - or when asked, `EXACT_CAST` - we round with integer arithmetic on
the float32 bits, `e4m3_rne_bits`; both give the same bytes as torch's cast. The interpreter also
decodes the e4m3 NaN byte (0x7F) as 480, hence `FIX_NAN` on loads, truncates float32 -> bfloat16 and
converts bfloat16 subnormals wrongly both ways, hence bfloat16 passed as raw int16 bits under the interpreter
(`X_BF16_BITS`, `OUT_BF16_BITS`). On a GPU none of these detours is taken.

Limits: block_size must be a power of two; inputs are made contiguous (one copy if they are not).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import interpreting

# ---------------------------------------------------------------- shared jit helpers


@triton.jit
def block_amax(x, axis: tl.constexpr):
    """max |x| along `axis`, NaN if any element is NaN (like torch.amax).

    NaN is counted apart rather than with a NaN-propagating combine function: tl.max's own NaN behaviour
    is not specified, and a custom tl.reduce costs the interpreter one Python call per element."""
    amax = tl.max(tl.abs(x), axis)
    has_nan = tl.max((x != x).to(tl.int32), axis)
    return tl.where(has_nan > 0, float("nan"), amax)


@triton.jit
def scale_exponent(amax, RCEIL: tl.constexpr):
    """amax (float32) -> biased E8M0 exponent (int32); mirrors kernels.mxfp8.scale_exponent."""
    if RCEIL:
        q = tl.math.div_rn(amax, 448.0)  # correctly rounded, as torch's division
        qb = q.to(tl.int32, bitcast=True)
        exp = (qb >> 23) & 0xFF
        man = qb & 0x7FFFFF
        biased = tl.where(exp == 0, (man > 0x400000).to(tl.int32), exp + (man != 0).to(tl.int32))
        biased = tl.where(amax == float("inf"), 254, biased)
    else:
        biased = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 8, 0)
    return tl.where(amax != amax, 255, biased)  # 255: kernels/mxfp8.py's E8M0_NAN (a test checks they agree)


@triton.jit
def scale_multiplier(biased, RCEIL: tl.constexpr):
    """1 / scale as float32 (exact, from bits); mirrors kernels.mxfp8.scale_multiplier."""
    if RCEIL:
        r = (tl.maximum(254 - biased, 0) << 23).to(tl.float32, bitcast=True)
        r = tl.where(biased == 0, 1.0, r)
        r = tl.where(biased == 254, 5.877471754111438e-39, r)  # 2**-127
        r = tl.where(biased == 255, float("nan"), r)
    else:
        b = tl.maximum(biased, 1)
        r = (tl.maximum(254 - b, 0) << 23).to(tl.float32, bitcast=True)
        r = tl.where(biased == 255, 0.0, r)
    return r


@triton.jit
def e8m0_to_float32(s):
    """E8M0 bytes (uint8) -> float32: byte 0 is 2**-127, byte 255 is NaN."""
    b = s.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_rne_bits(y):
    """float32 in [-448, 448] (or NaN) -> e4m3fn byte (uint8), rounded to nearest-even by integer math."""
    sign = ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
    a = tl.abs(y)
    ab = a.to(tl.int32, bitcast=True)
    # Normal e4m3 (a >= 2**-6): drop 20 of float32's 23 mantissa bits with ties to even, then rebias the
    # exponent from 127 to 7; a mantissa carry rolls into the exponent by itself.
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal e4m3 counts multiples of 2**-9; adding and removing 1.5 * 2**23 rounds to nearest-even.
    # (Code 8 = 2**-6 falls out as the smallest normal.)
    sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    code = tl.where(y != y, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def to_e4m3_bits(y, EXACT_CAST: tl.constexpr):
    """float32 already clamped to +-448 -> e4m3fn byte (uint8)."""
    if EXACT_CAST:
        return e4m3_rne_bits(y)
    else:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def e4m3_to_float32(v, FIX_NAN: tl.constexpr):
    """Loaded float8e4nv -> float32; FIX_NAN repairs the interpreter's decoding of the NaN byte."""
    f = v.to(tl.float32)
    if FIX_NAN:
        f = tl.where(tl.abs(f) == 480.0, float("nan"), f)
    return f


@triton.jit
def bf16_bits_to_float32(v):
    """bfloat16 loaded as int16 bits -> float32 (exact: bfloat16 is the top half of float32)."""
    return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def float32_to_bf16_bits(f):
    """float32 -> bfloat16 bits (int16), nearest-even; the interpreter's own cast truncates."""
    b = f.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(f != f, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def load_f32(ptrs, mask, BITS: tl.constexpr):
    """Values at ptrs as float32; BITS: they are bf16 held as int16 bits (the interpreter has no bf16)."""
    v = tl.load(ptrs, mask=mask, other=0)
    if BITS:
        return bf16_bits_to_float32(v)
    return v.to(tl.float32)


@triton.jit
def store_f32(ptrs, v, mask, BITS: tl.constexpr):
    """float32 v stored in ptrs' element type (as bf16 bits with BITS)."""
    if BITS:
        tl.store(ptrs, float32_to_bf16_bits(v), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def quantize_rows_mx(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EXACT_CAST: tl.constexpr):
    """float32 [M, K] -> (e4m3 [M, K], E8M0 uint8 [M, K // 32]), rceil, blocks of 32 along K."""
    a3 = tl.reshape(a, (BLOCK_M, BLOCK_K // 32, 32))
    biased = scale_exponent(block_amax(a3, 2), True)
    y = a3 * scale_multiplier(biased, True)[:, :, None]
    y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    codes = tl.reshape(to_e4m3_bits(y, EXACT_CAST), (BLOCK_M, BLOCK_K))
    return codes.to(tl.float8e4nv, bitcast=True), biased.to(tl.uint8)


@triton.jit
def mx_load(w_ptr, s_ptr, n_N, ok_N, k0, K, stride_wn, stride_sn, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    """One MXFP8 tile of W: codes [N, BLOCK_K] (rows n_N, columns k0.., zero from K on) and their E8M0
    scales [N, BLOCK_K // 32] (one byte per 32 codes, 127 = 1.0 past K), each loaded once. ALIGNED: k0 is a
    multiple of BLOCK_K, and the hints say so (the compiler cannot see it when k0 is a runtime split start),
    so that codes arrive in 16-byte loads; hints change no value."""
    k_K = k0 + tl.arange(0, BLOCK_K)
    g_G = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    if ALIGNED:
        k_K = tl.max_contiguous(tl.multiple_of(k_K, BLOCK_K), BLOCK_K)
        g_G = tl.max_contiguous(tl.multiple_of(g_G, BLOCK_K // 32), BLOCK_K // 32)
    w_NK = tl.load(w_ptr + n_N[:, None] * stride_wn + k_K[None, :], mask=ok_N[:, None] & (k_K < K)[None, :],
                   other=0.0)
    s_NG = tl.load(s_ptr + n_N[:, None] * stride_sn + g_G[None, :], mask=ok_N[:, None] & (g_G < K // 32)[None, :],
                   other=127)
    return w_NK, s_NG


@triton.jit
def mx_dequant(w_NK, s_NG, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [N, BLOCK_K]: codes times their block's scale (exact: an fp8 code times a power of two)."""
    return tl.reshape(tl.reshape(w_NK.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32))
                      * e8m0_to_float32(s_NG)[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def dot_acc(acc, p, q, F32_DOT: tl.constexpr):
    """acc + p @ q in float32: operands in bf16 (the MMA's), or in float32 with F32_DOT (the interpreter,
    which has no bf16 arithmetic)."""
    if F32_DOT:
        acc = tl.dot(p.to(tl.float32), q.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(tl.bfloat16), q.to(tl.bfloat16), acc)
    return acc


@triton.jit
def mx_dot(acc, a, w_ptr, s_ptr, n_N, ok_N, k0, K, stride_wn, stride_sn,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_SCALED: tl.constexpr,
           F32_DOT: tl.constexpr, EXACT_CAST: tl.constexpr):
    """acc [M, N] += a [M, K-tile] @ W[n_N, k0:k0+BLOCK_K].T, W in MXFP8 (fp8 rows + one E8M0 scale per 32
    codes): the MoE kernels' one multiply. DOT_SCALED (sm_100+): a is quantized to MXFP8 in registers and
    both go to the block-scaled MMA. Else (sm_90, the interpreter): W is dequantized in registers, each
    scale broadcast over its 32 codes, and multiplied in bf16 (float32 with F32_DOT) into float32 acc."""
    w_NK, s_NG = mx_load(w_ptr, s_ptr, n_N, ok_N, k0, K, stride_wn, stride_sn, BLOCK_K, False)
    if DOT_SCALED:
        a_q, a_s = quantize_rows_mx(a.to(tl.float32), BLOCK_M, BLOCK_K, EXACT_CAST)
        acc = tl.dot_scaled(a_q, a_s, "e4m3", tl.trans(w_NK), s_NG, "e4m3", acc)
    else:
        acc = dot_acc(acc, a, tl.trans(mx_dequant(w_NK, s_NG, BLOCK_N, BLOCK_K)), F32_DOT)
    return acc


@triton.jit
def mx_rows_matmul(acc, a_ptr, rows_M, ok_M, stride_am, w_ptr, s_ptr, n_N, ok_N, K, stride_wn, stride_sn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_SCALED: tl.constexpr,
                   F32_DOT: tl.constexpr, EXACT_CAST: tl.constexpr):
    """acc [M, N] += A[rows_M, :K] @ W[n_N, :K].T (rows where ok_M; W in MXFP8): a whole reduction."""
    for k0 in range(0, K, BLOCK_K):
        k_K = k0 + tl.arange(0, BLOCK_K)
        a_MK = tl.load(a_ptr + rows_M[:, None] * stride_am + k_K[None, :], mask=ok_M[:, None] & (k_K < K)[None, :],
                       other=0.0)
        acc = mx_dot(acc, a_MK, w_ptr, s_ptr, n_N, ok_N, k0, K, stride_wn, stride_sn,
                     BLOCK_M, BLOCK_N, BLOCK_K, DOT_SCALED, F32_DOT, EXACT_CAST)
    return acc


@triton.jit
def mx_swiglu_rows(x_ptr, rows_M, ok_M, stride_xm, w_ptr, s_ptr, n_N, ok_N, D, INTER, stride_wn, stride_sn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_SCALED: tl.constexpr,
                   F32_DOT: tl.constexpr, EXACT_CAST: tl.constexpr):
    """silu(gate) * up [M, N] for x's rows_M against one expert's w13 [2I, D] (gate rows n_N, up rows
    I + n_N), both from one load of each x tile."""
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_K = k0 + tl.arange(0, BLOCK_K)
        x_MK = tl.load(x_ptr + rows_M[:, None] * stride_xm + k_K[None, :], mask=ok_M[:, None] & (k_K < D)[None, :],
                       other=0.0)
        acc_gate = mx_dot(acc_gate, x_MK, w_ptr, s_ptr, n_N, ok_N, k0, D, stride_wn, stride_sn,
                          BLOCK_M, BLOCK_N, BLOCK_K, DOT_SCALED, F32_DOT, EXACT_CAST)
        acc_up = mx_dot(acc_up, x_MK, w_ptr, s_ptr, n_N + INTER, ok_N, k0, D, stride_wn, stride_sn,
                        BLOCK_M, BLOCK_N, BLOCK_K, DOT_SCALED, F32_DOT, EXACT_CAST)
    return acc_gate * tl.sigmoid(acc_gate) * acc_up


# ---------------------------------------------------------------- kernels


@triton.jit
def _quantize_kernel(x_ptr, data_ptr, scale_ptr, n_blocks,
                     BLOCK: tl.constexpr, BLOCK_G: tl.constexpr, RCEIL: tl.constexpr,
                     EXACT_CAST: tl.constexpr, X_BF16_BITS: tl.constexpr):
    pid = tl.program_id(0)
    g_G = pid.to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)  # block index, int64 for huge tensors
    ok_G = g_G < n_blocks
    offs_GB = g_G[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x_GB = tl.load(x_ptr + offs_GB, mask=ok_G[:, None], other=0)
    if X_BF16_BITS:
        x_GB = bf16_bits_to_float32(x_GB)
    else:
        x_GB = x_GB.to(tl.float32)
    biased_G = scale_exponent(block_amax(x_GB, 1), RCEIL)
    y_GB = x_GB * scale_multiplier(biased_G, RCEIL)[:, None]
    y_GB = tl.clamp(y_GB, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(data_ptr + offs_GB, to_e4m3_bits(y_GB, EXACT_CAST), mask=ok_G[:, None])
    tl.store(scale_ptr + g_G, biased_G.to(tl.uint8), mask=ok_G)


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, out_ptr, n_blocks,
                       BLOCK: tl.constexpr, BLOCK_G: tl.constexpr, FIX_NAN: tl.constexpr,
                       OUT_BF16_BITS: tl.constexpr):
    pid = tl.program_id(0)
    g_G = pid.to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    ok_G = g_G < n_blocks
    offs_GB = g_G[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    d_GB = e4m3_to_float32(tl.load(data_ptr + offs_GB, mask=ok_G[:, None], other=0.0), FIX_NAN)
    s_G = e8m0_to_float32(tl.load(scale_ptr + g_G, mask=ok_G, other=127))
    out_GB = d_GB * s_G[:, None]
    if OUT_BF16_BITS:
        out_GB = float32_to_bf16_bits(out_GB)
    else:
        out_GB = out_GB.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_GB, out_GB, mask=ok_G[:, None])


# ---------------------------------------------------------------- wrappers


def _blocks_per_program() -> int:
    # 64 blocks = 2048 elements per program on a GPU; the interpreter pays per program, so fewer, larger.
    return 256 if interpreting() else 64


def quantize_mxfp8_triton(x: torch.Tensor, block_size: int = 32, scale_mode: str = "rceil",
                          exact_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.quantize_mxfp8 (which validates arguments and calls this)."""
    x = x.contiguous()
    # The interpreter converts bfloat16 subnormals wrongly: hand it the raw bits instead.
    x_bits = interpreting() and x.dtype == torch.bfloat16
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // block_size), dtype=torch.uint8, device=x.device)
    n_blocks = scales.numel()
    if n_blocks:
        block_g = _blocks_per_program()
        _quantize_kernel[(triton.cdiv(n_blocks, block_g),)](
            x.view(torch.int16) if x_bits else x, data.view(torch.uint8), scales, n_blocks,
            BLOCK=block_size, BLOCK_G=block_g, RCEIL=scale_mode == "rceil",
            EXACT_CAST=interpreting() if exact_cast is None else exact_cast, X_BF16_BITS=x_bits,
            num_warps=4)
    return data, scales.view(torch.float8_e8m0fnu)


def dequantize_mxfp8_triton(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                            block_size: int = 32) -> torch.Tensor:
    data, scales = data.contiguous(), scales.contiguous().view(torch.uint8)
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    out_bits = interpreting() and dtype == torch.bfloat16  # the interpreter rounds to bfloat16 wrongly
    n_blocks = scales.numel()
    if n_blocks:
        block_g = _blocks_per_program()
        _dequantize_kernel[(triton.cdiv(n_blocks, block_g),)](
            data, scales, out.view(torch.int16) if out_bits else out, n_blocks, BLOCK=block_size,
            BLOCK_G=block_g, FIX_NAN=interpreting(), OUT_BF16_BITS=out_bits, num_warps=4)
    return out


