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
from kernels.moe_decode_triton import _routed
from kernels.mxfp8 import MXFP8Tensor
from kernels.mxfp8_triton import e8m0_to_float32

DECODE_VARIANT_MAX_TOKENS = 64  # the speculative-verification and batching shapes the tuner covers
MODES = {"dot": 0, "swap": 1, "fma": 2}


@triton.jit
def _w_tile(w_ptr, s_ptr, n_N, ok_N, k0, k_end, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K]: MXFP8 rows n_N, columns k0.. (k0 a multiple of BLOCK_K), zero from k_end on.
    The hints say that a tile's columns start at a multiple of its width (the split's k_end is a runtime
    minimum): compiled as the launcher specialises the arguments, codes arrive in 16-byte cp.async copies."""
    k_K = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    w_NK = tl.load(w_ptr + n_N[:, None] * stride_wn + k_K[None, :], mask=ok_N[:, None] & (k_K < k_end)[None, :],
                   other=0.0)
    g_G = tl.max_contiguous(tl.multiple_of(k0 // 32 + tl.arange(0, BLOCK_K // 32), BLOCK_K // 32), BLOCK_K // 32)
    s_NG = tl.load(s_ptr + n_N[:, None] * stride_sn + g_G[None, :],
                   mask=ok_N[:, None] & (g_G < k_end // 32)[None, :], other=127)
    return tl.reshape(tl.reshape(w_NK.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32))
                      * e8m0_to_float32(s_NG)[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def _mac(acc, a_TK, w_NK, MODE: tl.constexpr, F32_DOT: tl.constexpr):
    """acc += a @ w.T: acc [BLOCK_T, BLOCK_N] ("dot", "fma") or its transpose [BLOCK_N, BLOCK_T] ("swap")."""
    if MODE == 2:
        acc += tl.sum(a_TK.to(tl.float32)[:, None, :] * w_NK[None, :, :], axis=2)
    elif MODE == 1:
        if F32_DOT:
            acc = tl.dot(w_NK, tl.trans(a_TK.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w_NK.to(tl.bfloat16), tl.trans(a_TK.to(tl.bfloat16)), acc)
    else:
        if F32_DOT:
            acc = tl.dot(a_TK.to(tl.float32), tl.trans(w_NK), acc, input_precision="ieee")
        else:
            acc = tl.dot(a_TK.to(tl.bfloat16), tl.trans(w_NK.to(tl.bfloat16)), acc)
    return acc


@triton.jit
def _zeros(BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    if MODE == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    return acc


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
    n_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok_N = n_N < INTER
    split = tl.program_id(2)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, D)
    w_ptr += expert * stride_we
    s_ptr += expert * stride_se
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
    n_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok_N = n_N < D
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
            a_TK = gate * tl.sigmoid(gate) * up
            if ROUND_BF16:
                a_TK = a_TK.to(tl.bfloat16)
            if ROUND_F16:
                a_TK = a_TK.to(tl.float16)
        acc = _mac(acc, a_TK, _w_tile(w_ptr, s_ptr, n_N, ok_N, k0, INTER, stride_wn, stride_sn, BLOCK_N, BLOCK_K),
                   MODE, F32_DOT)
    if MODE == 1:
        acc = tl.trans(acc)
    weight_T = tl.load(weights_ptr + (pair_T // TOP_K) * stride_wt + pair_T % TOP_K, mask=hit_T, other=0.0)
    acc = acc * weight_T.to(tl.float32)[:, None]
    tl.store(out_ptr + pair_T[:, None] * stride_op + n_N[None, :], acc, mask=hit_T[:, None] & ok_N[None, :])


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
    """One point of the sweep: which multiply, gate_up's split over D, and each kernel's tiles."""

    variant: str  # "dot", "swap" or "fma"
    gate_up: KernelTiles
    down: KernelTiles
    split_k: int = 1

    def __post_init__(self):
        if self.variant not in MODES:
            raise ValueError(f"variant must be one of {tuple(MODES)}, not {self.variant!r}")
        for t in (self.gate_up, self.down):
            if t.block_k < 32 or t.block_k & (t.block_k - 1) or t.block_n & (t.block_n - 1):
                raise ValueError(f"tile widths must be powers of two, block_k >= 32: {t}")
        if not 1 <= self.split_k <= 16:
            raise ValueError(f"split_k must be in 1..16, not {self.split_k}")

    def to_json(self) -> dict:
        return {"variant": self.variant, "split_k": self.split_k, "gate_up": self.gate_up.to_json(),
                "down": self.down.to_json()}

    @staticmethod
    def from_json(entry: dict) -> VariantConfig:
        return VariantConfig(entry["variant"], KernelTiles(**entry["gate_up"]), KernelTiles(**entry["down"]),
                             entry.get("split_k", 1))

    def label(self) -> str:
        g, d = self.gate_up, self.down
        return (f"{self.variant} split{self.split_k} gu{g.block_n}x{g.block_k}w{g.num_warps}s{g.num_stages} "
                f"dn{d.block_n}x{d.block_k}w{d.num_warps}s{d.num_stages}")


def _block_t(T: int, variant: str) -> int:
    # tl.dot wants 16 rows at least; the broadcast multiply takes exactly the next power of two
    return triton.next_power_of_2(T) if variant == "fma" else max(16, triton.next_power_of_2(T))


class VariantLaunches:
    """One layer's buffers and its two launches, apart, so that a benchmark can time each inside a graph.
    `gate_up()` then `down()` computes the layer; `rows()` is then the weighted per-pair rows [T, K, D]."""

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
        # a split no shorter than one K tile, and the same for every program (the last one masks past D)
        self.k_per_split = triton.cdiv(triton.cdiv(D, config.split_k), self.gk) * self.gk
        self.split = triton.cdiv(D, self.k_per_split)
        dev = x_TD.device
        if self.split > 1:
            self.h = torch.empty((self.split, T * K, 2 * inter), dtype=torch.float32, device=dev)
        else:  # h in x's dtype, as a bf16 model rounds it (float32 under the interpreter, whose bf16 cast truncates)
            self.h = torch.empty((T * K, inter), dtype=torch.float32 if interp else x_TD.dtype, device=dev)
        self.out = torch.empty((T * K, D), dtype=torch.float32, device=dev)
        self.block_t = _block_t(T, config.variant)
        self.block_kk = triton.next_power_of_2(K)

    def gate_up(self) -> None:
        c, gu = self.config, self.config.gate_up
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
