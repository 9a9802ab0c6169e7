"""The MoE seam: the one function the model (serve/model, train) calls for a Qwen3-MoE expert layer.

    moe_forward(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, *, backend="auto", mma="auto",
                cpu_packed=None) -> out_TD

    T tokens, D hidden size, K experts per token, E experts, I expert intermediate size.
    x_TD            [T, D]      bf16 (fp16/fp32 accepted) hidden states
    topk_ids_TK     [T, K]      int, expert of each token's k-th choice, in [0, E), distinct per token
    topk_weights_TK [T, K]      float, router weights as the model wants them (Qwen3: softmax over the
                                top-k logits when norm_topk_prob, else the top-k of the full softmax)
    w13             [E, 2I, D]  gate_up_proj: rows [gate; up] (Qwen3-MoE / HF `gate_up_proj` layout)
    w2              [E, D, I]   down_proj
    returns         [T, D]      in x's dtype: sum_k w[t,k] * w2[e] @ (silu(gate_e x_t) * up_e x_t)

w13 and w2 are both plain tensors (bf16/fp32: the grouped torch reference runs, differentiable, for
parity checks and bf16 baselines; serving bf16 on an sm_90+ GPU takes moe_grouped.moe_grouped_forward
instead: two grouped GEMMs, no host sync, CUDA-graph capturable) or both `MXFP8Tensor` (data [E, N,
Kred] float8_e4m3fn + scales [E, N, Kred // 32] E8M0, from `MXFP8Tensor.quantize(w)`): the fused Triton
kernels run on a GPU, or under the interpreter on the CPU when TRITON_INTERPRET=1; otherwise (CPU
serving) the reference runs on the dequantized weights. The kernel path does not build an autograd graph; for training in the served
precision use `kernels.mxfp8_linear.mxfp8_moe` (same forward, gradients to master weights).

`backend` forces "triton" or "torch"; `mma` picks the kernel's matrix multiply ("dequant" for sm_90,
"dot_scaled" for sm_100+, "auto" by device); see kernels/moe_triton.py. `cpu_packed` (CPU inference
with plain weights) is `kernels.moe_reference.pack_experts(w13, w2)`, used by the all-experts path.

CPU inference with our C++ kernels built (`cpu_kernels`, from kernels/cpu_ext.py) takes the weights
blocked for them (`block_experts`; the model's `pack_for_cpu` does that: w13 [E, ceil(2I / 32), D, 32],
w2 [E, ceil(D / 32), I, 32]) and runs every routed expert in one kernel call (csrc/moe_cpu.cpp): each
expert's few decode rows stream its weights once near memory bandwidth, and no torch op runs per
expert. Plain weights (on a CPU, stored input-major by `pack_for_cpu` without kernels) pick one of two
torch paths per call by what each would touch, priced with measured costs (`CpuCosts`): grouped (pairs
sorted by expert, two matmuls per expert that got any: reads only those experts, does only the routed
FLOPs, ~2 ops per hit expert) or all-experts (every expert on every token in two big matmuls: all
experts' bytes, E / K times the FLOPs, a fixed handful of ops). Grouped wins unless a batch is tiny and
hits every expert anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from kernels.backend import Backend, use_triton
from kernels.moe_grouped import grouped_available, moe_grouped_forward
from kernels.moe_reference import moe_all_experts, moe_grouped_cpu, moe_reference
from kernels.mxfp8 import MXFP8Tensor


@dataclass(frozen=True)
class CpuCosts:
    """What the CPU expert paths cost, measured with `measure_cpu_costs()` on the development VM (2 cores,
    torch's default threads): weight bytes a few-row matmul streams per second, matmul FLOPs per
    second, and the fixed cost of one small torch op. Only their ratios matter for the choice."""

    bytes_per_s: float = 12e9
    flops_per_s: float = 60e9
    op_s: float = 10e-6


CPU_COSTS = CpuCosts()


def cpu_path_costs(T: int, K: int, counts_E: list[int], D: int, inter: int, itemsize: int,
                   costs: CpuCosts = CPU_COSTS) -> dict[str, float]:
    """Estimated seconds of the grouped and the all-experts path for T tokens with K experts each,
    `counts_E` pairs per expert, hidden size D, expert intermediate size `inter`."""
    E, hit = len(counts_E), sum(1 for n in counts_E if n)
    expert_bytes, token_flops = 3 * D * inter * itemsize, 6 * D * inter  # w13 + w2; 2 FLOPs per MAC

    def price(nbytes: float, flops: float, ops: int) -> float:
        return nbytes / costs.bytes_per_s + flops / costs.flops_per_s + ops * costs.op_s

    return {"grouped": price(hit * expert_bytes, T * K * token_flops, 2 * hit + 9),
            "all": price(E * expert_bytes, T * E * token_flops, 8)}


def measure_cpu_costs(D: int = 768, inter: int = 384, repeat: int = 20) -> CpuCosts:
    """Measure CpuCosts on this machine (about a second): a 2-row matmul over 16 distinct weights
    (streams them from memory), a square matmul (FLOPs), a small elementwise op (per-op cost)."""
    import time

    def timed(fn, n: int) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    ws = [torch.randn(2 * inter, D) for _ in range(16)]
    x2 = torch.randn(2, D)
    stream = timed(lambda: [x2 @ w.T for w in ws], repeat) / len(ws)
    a = torch.randn(512, 512)
    flops = timed(lambda: a @ a, repeat)
    small = torch.randn(8, D)
    op = timed(lambda: torch.nn.functional.silu(small), repeat * 50)
    return CpuCosts(bytes_per_s=ws[0].nbytes / stream, flops_per_s=2 * 512**3 / flops, op_s=op)


def moe_forward(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                w13: torch.Tensor | MXFP8Tensor, w2: torch.Tensor | MXFP8Tensor, *,
                backend: Backend = "auto", mma: str = "auto", cpu_packed: tuple[torch.Tensor, torch.Tensor] | None = None,
                cpu_kernels: ModuleType | None = None, reduce: bool = True) -> torch.Tensor:
    """`reduce=False`: where the Triton MXFP8 kernels run, their weighted float32 per-pair rows [T, K, D]
    instead of the sum over K (kernels.fused.add_rms_norm sums them with the residual in its own launch:
    one kernel fewer per decode layer); every other path returns [T, D] as usual."""
    _check(x_TD, topk_ids_TK, topk_weights_TK, w13, w2)
    if isinstance(w13, MXFP8Tensor):
        if _dense_on_cpu(x_TD, w13, w2) and backend != "triton" and mma != "dot_scaled" \
                and not torch.is_grad_enabled():
            # held dequantized by a CPU server (MXFP8Tensor.with_dense): the grouped reference's arithmetic
            # in as few ops, the same sums in the same order (a float64 server's tokens do not change), two
            # matmuls per expert hit instead of ~10 ops (verifying a draft hits more experts than a decode);
            # taken before the Triton interpreter too, which a test session may have switched on
            if few_rows_f64(x_TD, w13.dense, w2.dense, cpu_kernels):  # bfloat16 copies where held (`narrow`)
                n13, n2 = (w13.narrow, w2.narrow) if w13.narrow is not None and w2.narrow is not None \
                    and w13.narrow.dtype == w2.narrow.dtype else (w13.dense, w2.dense)
                return cpu_kernels.moe_experts_f64(x_TD.contiguous(), topk_ids_TK.contiguous(),
                                                   topk_weights_TK.contiguous(), n13, n2)
            return moe_grouped_cpu(x_TD, topk_ids_TK, topk_weights_TK, w13.dense, w2.dense)
        if use_triton(x_TD.device, backend):
            from kernels.moe_triton import fused_moe_mxfp8
            return fused_moe_mxfp8(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, mma=mma, reduce=reduce)
        return moe_reference(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, act_mxfp8=mma == "dot_scaled")
    if backend == "triton":
        raise ValueError("the Triton MoE path takes MXFP8 weights: pass MXFP8Tensor.quantize(w)")
    if blocked(w13) or blocked(w2):
        if not (blocked(w13) and blocked(w2)) or cpu_kernels is None or x_TD.device.type != "cpu" \
                or torch.is_grad_enabled() or x_TD.dtype != w13.dtype:
            raise ValueError("blocked expert weights (block_experts) run only through the CPU kernel, in "
                             "inference, with x in their dtype: pass cpu_kernels, or unblock_experts them")
        return moe_grouped_kernel(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, cpu_kernels)
    if x_TD.device.type == "cpu" and not torch.is_grad_enabled():
        if few_rows_f64(x_TD, w13, w2, cpu_kernels):
            return cpu_kernels.moe_experts_f64(x_TD.contiguous(), topk_ids_TK.contiguous(),
                                               topk_weights_TK.contiguous(), w13, w2)
        T, K = topk_ids_TK.shape
        counts_E = torch.bincount(topk_ids_TK.reshape(-1), minlength=w13.shape[0]).tolist()
        cost = cpu_path_costs(T, K, counts_E, x_TD.shape[1], w2.shape[2], w13.element_size())
        if cost["all"] < cost["grouped"]:
            return moe_all_experts(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, cpu_packed)
        return moe_grouped_cpu(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, counts_E)
    if x_TD.device.type == "cuda" and not torch.is_grad_enabled() and x_TD.dtype == w13.dtype \
            and grouped_available(x_TD.dtype, x_TD.device):  # serving bf16 experts: grouped GEMMs, no sync
        return moe_grouped_forward(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, grouped=True)
    return moe_reference(x_TD, topk_ids_TK, topk_weights_TK, w13, w2)


FEW_ROWS_F64 = 16
"""Rows a float64 MoE layer hands to the C++ expert kernel (a batch-1 decode, a verified draft): 2.1-4.1x
faster than the grouped torch path at 1-16 rows, 0.73-1.25x at 64 (bench/serve-results/f64_kernels_mb.py;
a prefill's rows go to the matmuls)."""


def few_rows_f64(x_TD: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, cpu_kernels: ModuleType | None) -> bool:
    """A float64 step of at most FEW_ROWS_F64 rows on plain contiguous weights, with the kernel built
    (kernels/csrc/moe_f64_cpu.cpp): inference on a CPU only, the callers' branches say so."""
    return (hasattr(cpu_kernels, "moe_experts_f64") and x_TD.shape[0] <= FEW_ROWS_F64
            and x_TD.dtype == w13.dtype == w2.dtype == torch.float64 and w13.is_contiguous() and w2.is_contiguous())


def _dense_on_cpu(x_TD: torch.Tensor, w13: MXFP8Tensor, w2: MXFP8Tensor) -> bool:
    return (x_TD.device.type == "cpu" and w13.dense is not None and w2.dense is not None
            and w13.dense.dtype == w2.dense.dtype == x_TD.dtype)


def block_experts(w_ENK: torch.Tensor, block: int) -> torch.Tensor:
    """Expert weights [E, N, K] as the CPU kernel reads them: each expert's input-major [K, N] cut into
    column blocks of `block` (the kernel's `moe_block_columns()`), each block a contiguous [K, block], the
    last one zero-padded: [E, ceil(N / block), K, block]. A decode step's few rows per expert then walk
    one contiguous stream per block instead of a few vectors from every row (csrc/moe_cpu.cpp, kBlock).
    bfloat16 rows hold columns c and c + block / 2 side by side, so that one 32-bit word widens into both."""
    E, N, K = w_ENK.shape
    blocks = -(-N // block)
    padded = torch.nn.functional.pad(w_ENK, (0, 0, 0, blocks * block - N)) if N % block else w_ENK
    out = padded.reshape(E, blocks, block, K).transpose(2, 3)
    if w_ENK.dtype == torch.bfloat16:
        return out[..., _paired(block)].contiguous()
    return out.contiguous()


def unblock_experts(w_EJKB: torch.Tensor, n: int) -> torch.Tensor:
    """`block_experts`' inverse: [E, N, K] (N = n, the padding dropped), a view where it can be."""
    E, J, K, B = w_EJKB.shape
    if w_EJKB.dtype == torch.bfloat16:
        w_EJKB = w_EJKB[..., torch.argsort(_paired(B))]
    return w_EJKB.transpose(2, 3).reshape(E, J * B, K)[:, :n]


def _paired(block: int) -> torch.Tensor:
    """The block column each position of a bfloat16 block row holds: 0, h, 1, h + 1, ... (h = block / 2)."""
    half = torch.arange(block // 2)
    return torch.stack([half, half + block // 2], 1).reshape(-1)


def blocked(w: torch.Tensor | MXFP8Tensor) -> bool:
    """Whether an expert weight is in `block_experts`' layout (4-D: every other form is [E, N, K])."""
    return isinstance(w, torch.Tensor) and w.dim() == 4


def input_major(w_ENK: torch.Tensor) -> bool:
    """Whether an [E, N, K] expert weight is stored as its contiguous [E, K, N] transpose."""
    return w_ENK.dim() == 3 and w_ENK.transpose(1, 2).is_contiguous()


def moe_grouped_kernel(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, cpu_kernels: ModuleType) -> torch.Tensor:
    """Every routed expert in one C++ call (csrc/moe_cpu.cpp), weights blocked (`block_experts`): the
    pairs sorted by expert, the experts, the router weights and each token's float32 sum in ascending
    expert order, as `moe_grouped_cpu`."""
    return cpu_kernels.moe_experts(x_TD.contiguous(), topk_ids_TK.long().contiguous(),
                                   topk_weights_TK.float().contiguous(), w13, w2)


def expert_shapes(w13: torch.Tensor | MXFP8Tensor, w2: torch.Tensor | MXFP8Tensor) -> tuple[tuple, tuple]:
    """w13's [E, 2I, D] and w2's [E, D, I], whatever their layout."""
    if blocked(w13) and blocked(w2):
        E, D, inter = w13.shape[0], w13.shape[2], w2.shape[2]
        return (E, 2 * inter, D), (w2.shape[0], D, inter)
    return tuple(w13.shape), tuple(w2.shape)


def _check(x_TD, topk_ids_TK, topk_weights_TK, w13, w2) -> None:
    if type(w13) is not type(w2) or not isinstance(w13, (torch.Tensor, MXFP8Tensor)):
        raise TypeError("w13 and w2 must both be tensors or both be MXFP8Tensor")
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD must be [T, D], got {tuple(x_TD.shape)}")
    T, D = x_TD.shape
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T or topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"topk ids {tuple(topk_ids_TK.shape)} and weights {tuple(topk_weights_TK.shape)} "
                         f"must both be [T={T}, K]")
    if topk_ids_TK.dtype.is_floating_point:
        raise TypeError(f"topk_ids_TK must be integer, not {topk_ids_TK.dtype}")
    s13, s2 = expert_shapes(w13, w2)
    if len(s13) != 3 or len(s2) != 3:
        raise ValueError("w13 must be [E, 2I, D] and w2 [E, D, I] (or both blocked)")
    E, two_i, d13 = s13
    if d13 != D or two_i % 2 or s2 != (E, D, two_i // 2):
        raise ValueError(f"with x [T, {D}]: w13 {s13} must be [E, 2I, {D}] and w2 {s2} must be [E, {D}, I]")
    for t in (topk_ids_TK, topk_weights_TK, w13.data if isinstance(w13, MXFP8Tensor) else w13,
              w2.data if isinstance(w2, MXFP8Tensor) else w2):
        if t.device != x_TD.device:
            raise ValueError(f"all inputs must be on {x_TD.device}, found one on {t.device}")
