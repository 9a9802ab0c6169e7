"""Variants of the decode MoE layer (MXFP8 experts, 1-64 tokens) that the tuner chooses between per shape.

kernels/moe_decode_triton.py's two GEMV-shaped kernels are the default up to 16 tokens; here are the same
two steps (gate_up then down, each active expert read once, by the programs of the first pair slot routed
to it; no sort, no host sync, capturable) with three knobs that bench/gpu_tune.py times on the GPU at the
decode step's exact shapes and writes into the device's table (kernels/tuning.py):

- split-K over the hidden dimension for gate_up (`split_k`): at 1 token the grid is 8 experts x I/BLOCK_N
  programs, too few to keep 132 SMs' loads in flight; SPLIT_K programs per tile each reduce D/SPLIT_K and
  write float32 partial gate and up rows [SPLIT_K, T*K, 2I]. The down kernel sums the partials in a fixed
  order (s = 0, 1, ...), applies silu(gate) * up and rounds h to x's dtype as it loads them: no third
  kernel, no atomics, deterministic.
- the multiply (`variant`): "dot" = tl.dot on a [BLOCK_T, BLOCK_K] token tile (BLOCK_T >= 16, as the
  default kernels); "swap" = swap-AB, the weights as the MMA's M side (tl.dot(W, x^T) -> [BLOCK_N,
  BLOCK_T]), so that a wide BLOCK_N fills the instruction's rows instead of padding the tokens; "fma" = no
  MMA at all, a broadcast multiply and a sum over K in registers (BLOCK_T = the next power of two >= T, no
  padding to 16): the plain GEMV for 1-4 tokens.
- the tiles (BLOCK_N, BLOCK_K, warps, stages) of each kernel: longer K tiles are wider loads of the codes
  (BLOCK_K contiguous bytes per row) and of their scales (BLOCK_K / 32 contiguous bytes per row).

Numerics are the default kernels': weights dequantized in registers (exact in bf16), bf16 operands on a
GPU (float32 under the interpreter), float32 accumulation, h rounded to x's dtype; split-K changes only the
order of the float32 sums. The output is kernels/moe_decode_triton.py's: weighted float32 per-pair rows
[T*K, D], summed over K by the caller (or returned unsummed with reduce=False).

Limits: nothing here has run on a GPU yet (aot_check compiles them for sm_90/sm_100; the interpreter checks
their results); down is not split over I (I = 768 is short, and its grid is already T*K x D/BLOCK_N); a
token picks an expert at most once; D and I multiples of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.backend import interpreting
from kernels.launches import launch
from kernels.moe_decode_triton import _routed, tile_cols, weighted_rows_store
from kernels.mxfp8 import MXFP8Tensor
from kernels.mxfp8_triton import dot_acc, mx_dequant, mx_load

DECODE_VARIANT_MAX_TOKENS = 64  # the speculative-verification and batching shapes the tuner covers
MODES = {"dot": 0, "swap": 1, "fma": 2}


@triton.jit
def _w_tile(w_ptr, s_ptr, n_N, ok_N, k0, k_end, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K]: MXFP8 rows n_N, columns k0.. (k0 a multiple of BLOCK_K), zero from k_end on:
    kernels/mxfp8_triton.py's loader (with its alignment hints: a split's start is a runtime value, and with
    them the codes arrive in 16-byte cp.async copies) and dequantizer, which the default kernels share."""
    w_NK, s_NG = mx_load(w_ptr, s_ptr, n_N, ok_N, k0, k_end, stride_wn, stride_sn, BLOCK_K, True)
    return mx_dequant(w_NK, s_NG, BLOCK_N, BLOCK_K)


@triton.jit
def _mac(acc, a_TK, w_NK, MODE: tl.constexpr, F32_DOT: tl.constexpr):
    """acc += a @ w.T: acc [BLOCK_T, BLOCK_N] ("dot", "fma") or its transpose [BLOCK_N, BLOCK_T] ("swap")."""
    if MODE == 2:
        acc += tl.sum(a_TK.to(tl.float32)[:, None, :] * w_NK[None, :, :], axis=2)
    elif MODE == 1:
        acc = dot_acc(acc, w_NK, tl.trans(a_TK), F32_DOT)
    else:
        acc = dot_acc(acc, a_TK, tl.trans(w_NK), F32_DOT)
    return acc


@triton.jit
def _zeros(BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    if MODE == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _gate_up_acc(x_ptr, hit_T, stride_xt, w_ptr, s_ptr, n_N, ok_N, k_begin, k_end, INTER, stride_wn, stride_sn,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
                 F32_DOT: tl.constexpr):
    """(gate, up) float32 [BLOCK_T, BLOCK_N] over x's columns k_begin..k_end: one expert's w13 gate rows n_N
    and up rows INTER + n_N, both against one load of each x tile (masked to the routed tokens)."""
    t_T = tl.arange(0, BLOCK_T).to(tl.int64)
    acc_gate = _zeros(BLOCK_T, BLOCK_N, MODE)
    acc_up = _zeros(BLOCK_T, BLOCK_N, MODE)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_K = k0 + tl.arange(0, BLOCK_K)
        x_TK = tl.load(x_ptr + t_T[:, None] * stride_xt + k_K[None, :], mask=hit_T[:, None] & (k_K < k_end)[None, :],
                       other=0.0)
        acc_gate = _mac(acc_gate, x_TK, _w_tile(w_ptr, s_ptr, n_N, ok_N, k0, k_end, stride_wn, stride_sn, BLOCK_N,
                                                BLOCK_K), MODE, F32_DOT)
        acc_up = _mac(acc_up, x_TK, _w_tile(w_ptr, s_ptr, n_N + INTER, ok_N, k0, k_end, stride_wn, stride_sn, BLOCK_N,
                                            BLOCK_K), MODE, F32_DOT)
    if MODE == 1:
        acc_gate = tl.trans(acc_gate)
        acc_up = tl.trans(acc_up)
    return acc_gate, acc_up


@triton.jit
def _round_h(h, ROUND_BF16: tl.constexpr, ROUND_F16: tl.constexpr):
    """h rounded to x's dtype, as a bf16 (fp16) model holds it between gate_up and down."""
    if ROUND_BF16:
        h = h.to(tl.bfloat16)
    if ROUND_F16:
        h = h.to(tl.float16)
    return h


@triton.jit
def _gate_up_variant_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, out_ptr, T, D, INTER, k_per_split,
                            stride_xt, stride_it, stride_we, stride_wn, stride_se, stride_sn, stride_op, stride_os,
                            TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KK: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
                            PARTIAL: tl.constexpr, F32_DOT: tl.constexpr):
    j = tl.program_id(0)
    expert, first_slot, hit_T, pair_T = _routed(ids_ptr, stride_it, T, j, TOP_K, BLOCK_T, BLOCK_KK)
    if first_slot != j:
        return  # another slot's programs read this expert
    n_N, ok_N = tile_cols(1, BLOCK_N, INTER)
    split = tl.program_id(2)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, D)
    acc_gate, acc_up = _gate_up_acc(x_ptr, hit_T, stride_xt, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
                                    n_N, ok_N, k_begin, k_end, INTER, stride_wn, stride_sn, BLOCK_T, BLOCK_N, BLOCK_K,
                                    MODE, F32_DOT)
    mask = hit_T[:, None] & ok_N[None, :]
    if PARTIAL:  # float32 partial sums; the down kernel finishes them
        rows = out_ptr + split * stride_os + pair_T[:, None] * stride_op
        tl.store(rows + n_N[None, :], acc_gate, mask=mask)
        tl.store(rows + INTER + n_N[None, :], acc_up, mask=mask)
    else:
        h_TN = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(out_ptr + pair_T[:, None] * stride_op + n_N[None, :], h_TN.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_variant_kernel(h_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, out_ptr, T, D, INTER,
                         stride_hp, stride_hs, stride_it, stride_wt, stride_we, stride_wn, stride_se, stride_sn,
                         stride_op,
                         TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KK: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, MODE: tl.constexpr, PARTS: tl.constexpr, ROUND_BF16: tl.constexpr,
                         ROUND_F16: tl.constexpr, F32_DOT: tl.constexpr):
    j = tl.program_id(0)
    expert, first_slot, hit_T, pair_T = _routed(ids_ptr, stride_it, T, j, TOP_K, BLOCK_T, BLOCK_KK)
    if first_slot != j:
        return
    n_N, ok_N = tile_cols(1, BLOCK_N, D)
    w_ptr += expert * stride_we
    s_ptr += expert * stride_se
    acc = _zeros(BLOCK_T, BLOCK_N, MODE)
    for k0 in range(0, INTER, BLOCK_K):
        k_K = k0 + tl.arange(0, BLOCK_K)
        mask = hit_T[:, None] & (k_K < INTER)[None, :]
        rows = h_ptr + pair_T[:, None] * stride_hp + k_K[None, :]
        if PARTS == 0:
            a_TK = tl.load(rows, mask=mask, other=0.0)
        else:  # gate_up's split-K partials: summed in split order, then silu(gate) * up, rounded as h would be
            gate = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
            up = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
            for s in tl.static_range(PARTS):
                gate += tl.load(rows + s * stride_hs, mask=mask, other=0.0)
                up += tl.load(rows + s * stride_hs + INTER, mask=mask, other=0.0)
            a_TK = _round_h(gate * tl.sigmoid(gate) * up, ROUND_BF16, ROUND_F16)
        acc = _mac(acc, a_TK, _w_tile(w_ptr, s_ptr, n_N, ok_N, k0, INTER, stride_wn, stride_sn, BLOCK_N, BLOCK_K),
                   MODE, F32_DOT)
    if MODE == 1:
        acc = tl.trans(acc)
    weighted_rows_store(acc, weights_ptr, out_ptr, pair_T, hit_T, n_N, ok_N, stride_wt, stride_op, TOP_K)


@triton.jit
def _fused_kernel(x_ptr, ids_ptr, w13_ptr, s13_ptr, w2_ptr, s2_ptr, part_ptr, T, D, INTER,
                  stride_xt, stride_it, stride_w13e, stride_w13n, stride_s13e, stride_s13n,
                  stride_w2e, stride_w2n, stride_s2e, stride_s2n, stride_ps, stride_pp,
                  TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KK: tl.constexpr, BLOCK_I: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr, ROUND_BF16: tl.constexpr,
                  ROUND_F16: tl.constexpr, F32_DOT: tl.constexpr):
    """gate_up, SwiGLU and down in one launch: program (slot j, slice s) owns columns s*BLOCK_I.. of the
    intermediate dimension for slot j's expert (first-slot rule), reads their gate and up rows over all of D,
    and multiplies its h slice by the same columns of w2 (all D rows, BLOCK_D at a time): its share of every
    routed pair's output, unweighted, into partial s. _sum_parts_kernel adds the slices in order."""
    j = tl.program_id(0)
    expert, first_slot, hit_T, pair_T = _routed(ids_ptr, stride_it, T, j, TOP_K, BLOCK_T, BLOCK_KK)
    if first_slot != j:
        return  # another slot's programs read this expert
    s = tl.program_id(1)
    i_I = s * BLOCK_I + tl.arange(0, BLOCK_I)
    gate, up = _gate_up_acc(x_ptr, hit_T, stride_xt, w13_ptr + expert * stride_w13e, s13_ptr + expert * stride_s13e,
                            i_I, i_I < INTER, 0, D, INTER, stride_w13n, stride_s13n, BLOCK_T, BLOCK_I, BLOCK_K, MODE,
                            F32_DOT)
    h_TI = _round_h(gate * tl.sigmoid(gate) * up, ROUND_BF16, ROUND_F16)  # 0 past I and for tokens not routed
    w2_ptr += expert * stride_w2e
    s2_ptr += expert * stride_s2e
    rows = part_ptr + s * stride_ps + pair_T[:, None] * stride_pp
    for d0 in range(0, D, BLOCK_D):
        d_N = d0 + tl.arange(0, BLOCK_D)
        ok_N = d_N < D
        acc = _mac(_zeros(BLOCK_T, BLOCK_D, MODE), h_TI, _w_tile(w2_ptr, s2_ptr, d_N, ok_N, s * BLOCK_I, INTER,
                                                                  stride_w2n, stride_s2n, BLOCK_D, BLOCK_I), MODE, F32_DOT)
        if MODE == 1:
            acc = tl.trans(acc)
        tl.store(rows + d_N[None, :], acc, mask=hit_T[:, None] & ok_N[None, :])


@triton.jit
def _sum_parts_kernel(part_ptr, weights_ptr, out_ptr, D, PARTS, stride_ps, stride_pp, stride_wt, stride_op,
                      TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Pair p's output row, columns of one BLOCK_D tile: the fused kernel's PARTS partial rows added in slice
    order (s = 0, 1, ...: fixed, no atomics), times the pair's router weight."""
    p_P = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    d_N = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok_N = d_N < D
    acc = tl.zeros((1, BLOCK_D), dtype=tl.float32)
    for s in range(0, PARTS):
        acc += tl.load(part_ptr + s * stride_ps + p_P[:, None] * stride_pp + d_N[None, :], mask=ok_N[None, :],
                       other=0.0)
    weighted_rows_store(acc, weights_ptr, out_ptr, p_P, p_P >= 0, d_N, ok_N, stride_wt, stride_op, TOP_K)


# ---------------------------------------------------------------- configs and launches


@dataclass(frozen=True)
class KernelTiles:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def to_json(self) -> dict:
        return {"block_n": self.block_n, "block_k": self.block_k, "num_warps": self.num_warps,
                "num_stages": self.num_stages}


@dataclass(frozen=True)
class VariantConfig:
    """One point of the sweep: which multiply, gate_up's split over D, and each kernel's tiles.

    fused=True: gate_up, SwiGLU and down in one kernel (_fused_kernel), then _sum_parts_kernel. Its tiles:
    gate_up = the fused kernel's (block_n: the slice of I a program owns, >= 32 (one E8M0 block of w2's
    columns); block_k: the D tile of its gate and up rows; warps, stages); down.block_n = the fused kernel's D
    tile of w2, down.block_k = the sum kernel's D tile, down's warps and stages the sum kernel's. No split_k."""

    variant: str  # "dot", "swap" or "fma"
    gate_up: KernelTiles
    down: KernelTiles
    split_k: int = 1
    fused: bool = False

    def __post_init__(self):
        if self.variant not in MODES:
            raise ValueError(f"variant must be one of {tuple(MODES)}, not {self.variant!r}")
        for t in (self.gate_up, self.down):
            if t.block_k < 32 or t.block_k & (t.block_k - 1) or t.block_n & (t.block_n - 1):
                raise ValueError(f"tile widths must be powers of two, block_k >= 32: {t}")
        if not 1 <= self.split_k <= 16:
            raise ValueError(f"split_k must be in 1..16, not {self.split_k}")
        if self.fused and (self.split_k != 1 or self.gate_up.block_n < 32):
            raise ValueError(f"the fused kernel takes no split_k and a slice of I (gate_up.block_n) >= 32: {self}")

    def to_json(self) -> dict:
        return {"variant": self.variant, "split_k": self.split_k, "gate_up": self.gate_up.to_json(),
                "down": self.down.to_json()} | ({"fused": True} if self.fused else {})

    @staticmethod
    def from_json(entry: dict) -> VariantConfig:
        return VariantConfig(entry["variant"], KernelTiles(**entry["gate_up"]), KernelTiles(**entry["down"]),
                             entry.get("split_k", 1), bool(entry.get("fused", False)))

    def label(self) -> str:
        g, d = self.gate_up, self.down
        if self.fused:
            return (f"fused-{self.variant} i{g.block_n}x{g.block_k}w{g.num_warps}s{g.num_stages} d{d.block_n} "
                    f"sum{d.block_k}w{d.num_warps}")
        return (f"{self.variant} split{self.split_k} gu{g.block_n}x{g.block_k}w{g.num_warps}s{g.num_stages} "
                f"dn{d.block_n}x{d.block_k}w{d.num_warps}s{d.num_stages}")


def _block_t(T: int, variant: str) -> int:
    # tl.dot wants 16 rows at least; the broadcast multiply takes exactly the next power of two
    return triton.next_power_of_2(T) if variant == "fma" else max(16, triton.next_power_of_2(T))


class VariantLaunches:
    """One layer's buffers and its two launches, apart, so that a benchmark can time each inside a graph.
    `gate_up()` then `down()` computes the layer; `rows()` is then the weighted per-pair rows [T, K, D].
    A fused config: `gate_up()` launches the fused kernel (gate_up, SwiGLU and down), `down()` the sum of its
    partials."""

    def __init__(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 w13: MXFP8Tensor, w2: MXFP8Tensor, config: VariantConfig):
        T, D = x_TD.shape
        K = topk_ids_TK.shape[1]
        inter = w2.shape[2]
        if not 0 < T <= DECODE_VARIANT_MAX_TOKENS:
            raise ValueError(f"the decode variants take 1..{DECODE_VARIANT_MAX_TOKENS} tokens, not {T}")
        if D % 32 or inter % 32:
            raise ValueError(f"D ({D}) and I ({inter}) must be multiples of 32")
        interp = interpreting()
        self.T, self.K, self.D, self.inter, self.config, self.interp = T, K, D, inter, config, interp
        self.x = x_TD.contiguous()
        self.ids = topk_ids_TK if topk_ids_TK.stride(1) == 1 else topk_ids_TK.contiguous()
        self.weights = topk_weights_TK if topk_weights_TK.stride(1) == 1 else topk_weights_TK.contiguous()
        self.w13_data, self.w13_scales = w13.data.contiguous(), w13.scales.contiguous().view(torch.uint8)
        self.w2_data, self.w2_scales = w2.data.contiguous(), w2.scales.contiguous().view(torch.uint8)
        gu = config.gate_up
        self.gk = min(gu.block_k, triton.next_power_of_2(D))  # a tile's width must be a power of two
        self.dk = min(config.down.block_k, triton.next_power_of_2(inter))
        self.block_t = _block_t(T, config.variant)
        self.block_kk = triton.next_power_of_2(K)
        self.out = torch.empty((T * K, D), dtype=torch.float32, device=x_TD.device)
        if config.fused:
            self.block_i = min(gu.block_n, max(32, triton.next_power_of_2(inter)))
            self.block_d = min(config.down.block_n, triton.next_power_of_2(D))
            self.sum_d = min(config.down.block_k, triton.next_power_of_2(D))
            self.split = 1
            self.parts = triton.cdiv(inter, self.block_i)  # each slice's unweighted share of every pair's row
            self.h = torch.empty((self.parts, T * K, D), dtype=torch.float32, device=x_TD.device)
            return
        # a split no shorter than one K tile, and the same for every program (the last one masks past D)
        self.k_per_split = triton.cdiv(triton.cdiv(D, config.split_k), self.gk) * self.gk
        self.split = triton.cdiv(D, self.k_per_split)
        dev = x_TD.device
        if self.split > 1:
            self.h = torch.empty((self.split, T * K, 2 * inter), dtype=torch.float32, device=dev)
        else:  # h in x's dtype, as a bf16 model rounds it (float32 under the interpreter, whose bf16 cast truncates)
            self.h = torch.empty((T * K, inter), dtype=torch.float32 if interp else x_TD.dtype, device=dev)

    def gate_up(self) -> None:
        c, gu = self.config, self.config.gate_up
        if c.fused:
            self._fused()
            return
        with launch("moe_decode_gate_up"):
            _gate_up_variant_kernel[(self.T * self.K, triton.cdiv(self.inter, gu.block_n), self.split)](
                self.x, self.ids, self.w13_data, self.w13_scales, self.h, self.T, self.D, self.inter, self.k_per_split,
                self.x.stride(0), self.ids.stride(0), self.w13_data.stride(0), self.w13_data.stride(1),
                self.w13_scales.stride(0), self.w13_scales.stride(1), self.h.stride(-2),
                self.h.stride(0) if self.split > 1 else 0,
                TOP_K=self.K, BLOCK_T=self.block_t, BLOCK_KK=self.block_kk, BLOCK_N=gu.block_n, BLOCK_K=self.gk,
                MODE=MODES[c.variant], PARTIAL=self.split > 1, F32_DOT=self.interp,
                num_warps=gu.num_warps, num_stages=gu.num_stages)

    def down(self) -> None:
        c, dn = self.config, self.config.down
        if c.fused:
            with launch("moe_decode_sum"):
                _sum_parts_kernel[(self.T * self.K, triton.cdiv(self.D, self.sum_d))](
                    self.h, self.weights, self.out, self.D, self.parts, self.h.stride(0), self.h.stride(1),
                    self.weights.stride(0), self.out.stride(0), TOP_K=self.K, BLOCK_D=self.sum_d,
                    num_warps=dn.num_warps, num_stages=dn.num_stages)
            return
        parts = self.split if self.split > 1 else 0
        rounding = None if self.interp else self.x.dtype
        with launch("moe_decode_down"):
            _down_variant_kernel[(self.T * self.K, triton.cdiv(self.D, dn.block_n))](
                self.h, self.ids, self.weights, self.w2_data, self.w2_scales, self.out, self.T, self.D, self.inter,
                self.h.stride(-2), self.h.stride(0) if parts else 0, self.ids.stride(0), self.weights.stride(0),
                self.w2_data.stride(0), self.w2_data.stride(1), self.w2_scales.stride(0), self.w2_scales.stride(1),
                self.out.stride(0),
                TOP_K=self.K, BLOCK_T=self.block_t, BLOCK_KK=self.block_kk, BLOCK_N=dn.block_n, BLOCK_K=self.dk,
                MODE=MODES[c.variant], PARTS=parts, ROUND_BF16=rounding == torch.bfloat16,
                ROUND_F16=rounding == torch.float16, F32_DOT=self.interp,
                num_warps=dn.num_warps, num_stages=dn.num_stages)

    def _fused(self) -> None:
        c, gu = self.config, self.config.gate_up
        rounding = None if self.interp else self.x.dtype
        with launch("moe_decode_fused"):
            _fused_kernel[(self.T * self.K, self.parts)](
                self.x, self.ids, self.w13_data, self.w13_scales, self.w2_data, self.w2_scales, self.h, self.T, self.D,
                self.inter, self.x.stride(0), self.ids.stride(0), self.w13_data.stride(0), self.w13_data.stride(1),
                self.w13_scales.stride(0), self.w13_scales.stride(1), self.w2_data.stride(0), self.w2_data.stride(1),
                self.w2_scales.stride(0), self.w2_scales.stride(1), self.h.stride(0), self.h.stride(1),
                TOP_K=self.K, BLOCK_T=self.block_t, BLOCK_KK=self.block_kk, BLOCK_I=self.block_i, BLOCK_K=self.gk,
                BLOCK_D=self.block_d, MODE=MODES[c.variant], ROUND_BF16=rounding == torch.bfloat16,
                ROUND_F16=rounding == torch.float16, F32_DOT=self.interp, num_warps=gu.num_warps,
                num_stages=gu.num_stages)

    def rows(self) -> torch.Tensor:
        return self.out.view(self.T, self.K, self.D)

    def expert_bytes(self) -> tuple[int, int]:
        """Bytes of expert codes + scales each kernel reads: (gate_up, down), for the experts these ids use."""
        return expert_bytes(self.ids, self.D, self.inter)


def expert_bytes(ids_TK: torch.Tensor, D: int, inter: int) -> tuple[int, int]:
    """(gate_up, down) bytes of MXFP8 codes + E8M0 scales that the active experts hold (each read once)."""
    n = int(torch.unique(ids_TK).numel())
    per = D * inter * (1 + 1 / 32)
    return int(n * 2 * per), int(n * per)


def moe_decode_variant(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                       w13: MXFP8Tensor, w2: MXFP8Tensor, config: VariantConfig, reduce: bool = True) -> torch.Tensor:
    """The layer through one variant: [T, D] in x's dtype, or (reduce=False) the float32 rows [T, K, D]."""
    run = VariantLaunches(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, config)
    run.gate_up()
    run.down()
    return run.rows().sum(dim=1).to(x_TD.dtype) if reduce else run.rows()


def tuned_choice(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, w13: MXFP8Tensor,
                 w2: MXFP8Tensor) -> VariantConfig | str | None:
    """kernels/moe_triton.py's hook: what the device's tuned table says for this shape: a variant's config,
    "grouped" (the sorted grouped kernels, which moe_triton owns), or None where the table has no entry or
    names the default path (the caller then runs what it always ran)."""
    from kernels.tuning import DTYPES, lookup

    T, D = x_TD.shape
    if T > DECODE_VARIANT_MAX_TOKENS or x_TD.dtype not in DTYPES:
        return None
    entry = lookup("moe_decode", DTYPES[x_TD.dtype], T=T, D=D, I=w2.shape[2], E=w13.shape[0], K=topk_ids_TK.shape[1])
    if entry is None or entry["variant"] == "default":
        return None
    return "grouped" if entry["variant"] == "grouped" else VariantConfig.from_json(entry)
