"""Torch references for the MoE layer (Qwen3-MoE experts): the ground truth the kernels are tested against,
the CPU serving path, and the differentiable path training uses.

Per token t and slot k, with e = topk_ids[t, k] and I the expert's intermediate size:
    gate_up = w13[e] @ x[t]                       # w13 = gate_up_proj [E, 2I, D]: rows [gate; up]
    h       = silu(gate_up[:I]) * gate_up[I:]     # SwiGLU
    out[t] += topk_weights[t, k] * (w2[e] @ h)    # w2 = down_proj [E, D, I]
Matmuls run in x's dtype (bf16 in serving, as a bf16 model would); the weighted sum over the K slots is
accumulated in float32 (float64 for float64 x) and rounded once to x's dtype.

`moe_reference` groups pairs by expert and loops over the experts that got any (what HF transformers
does; the bf16 baseline for the benchmark). `moe_reference_dense` runs every expert on every token and
masks: slow, obviously right, and used to check the grouped one. `act_mxfp8=True` rounds the inputs of
both matmuls through MXFP8 (rceil), which is what the sm_100 `tl.dot_scaled` kernel computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.mxfp8 import MXFP8Tensor, dequantize_mxfp8_reference, quantize_mxfp8_reference


def _fake_mxfp8(x: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp8_reference(*quantize_mxfp8_reference(x, 32, "rceil"), x.dtype)


def _as_dense(w: torch.Tensor | MXFP8Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, MXFP8Tensor):
        return dequantize_mxfp8_reference(w.data, w.scales, dtype)
    return w.to(dtype)


def _expert(w: torch.Tensor | MXFP8Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert's matrix in `dtype`; MXFP8 weights are dequantized one expert at a time, so a decode
    step on the CPU touches only the experts its tokens picked."""
    if isinstance(w, MXFP8Tensor):
        if w.dense is not None and w.dense.dtype == dtype:
            return w.dense[e]
        return dequantize_mxfp8_reference(w.data[e], w.scales[e], dtype)
    return w[e].to(dtype)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What sums, norms, rope and the router run in: float32, or the input's dtype where wider (float64
    serving). serve/model uses it too."""
    return torch.promote_types(dtype, torch.float32)


def moe_reference(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  w13, w2, act_mxfp8: bool = False, exact: bool = False) -> torch.Tensor:
    """Grouped reference; differentiable in x, topk_weights and (dense) w13/w2. `exact`: the model's
    batch-invariant numerics (serve/model/numerics.py): each matmul summed in float64 and rounded once to
    x's dtype, SwiGLU's silu in float64, the router-weighted sum in float64, so that no sum depends on the
    order it is taken in (the rounding points stay those of the default path)."""
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    inter = w2.shape[2]
    expert_P = topk_ids_TK.reshape(-1)
    acc = torch.float64 if exact else acc_dtype(x_TD.dtype)
    wdtype = torch.float32 if exact else x_TD.dtype  # float32 holds every MXFP8 value (fp16 may not)
    weight_P = topk_weights_TK.reshape(-1).to(acc)
    order = torch.argsort(expert_P, stable=True)
    experts, counts = torch.unique_consecutive(expert_P[order], return_counts=True)
    out_TD = torch.zeros(T, D, dtype=acc, device=x_TD.device)
    for e, pairs in zip(experts.tolist(), torch.split(order, counts.tolist()), strict=True):
        tokens = pairs // K
        x_ND = x_TD[tokens]
        if act_mxfp8:
            x_ND = _fake_mxfp8(x_ND)
        gate_up_N2I = _matmul(x_ND, _expert(w13, e, wdtype), exact)
        gate_N2I = gate_up_N2I[:, :inter]
        h_NI = (F.silu(gate_N2I.double()).to(gate_N2I.dtype) if exact else F.silu(gate_N2I)) * gate_up_N2I[:, inter:]
        if act_mxfp8:
            h_NI = _fake_mxfp8(h_NI)
        y_ND = _matmul(h_NI, _expert(w2, e, wdtype), exact)
        out_TD = out_TD.index_add(0, tokens, y_ND.to(acc) * weight_P[pairs, None])
    return out_TD.to(x_TD.dtype)


def _matmul(x_ND: torch.Tensor, w_MN: torch.Tensor, exact: bool) -> torch.Tensor:
    """x @ w.T in x's dtype; `exact`: summed in float64 (products of bf16/fp16/fp32 values and their sums
    are exact there), rounded once."""
    if exact:
        return (x_ND.double() @ w_MN.double().T).to(x_ND.dtype)
    return x_ND @ w_MN.to(x_ND.dtype).T


def moe_all_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor,
                    packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Every expert on every token in two batched matmuls, unselected experts weighted zero: E / K times
    the FLOPs of the grouped path and every expert's bytes, but a handful of ops whatever E is. It wins
    only where a batch hits (nearly) every expert and is so small that ops, not bytes or FLOPs, bound it
    (kernels/moe.py's cost model decides). Plain weights only; matmuls in x's dtype, the sum in float32.

    `packed` = (w13 as [E * 2I, D], w2 as [D, E * I]) packed by kernels.cpu_pack (see
    `pack_experts`): two plain-layout matmuls, the router weights applied before the second, which
    then also sums over experts; about twice as fast at decode sizes."""
    T, D = x_TD.shape
    E, inter = w13.shape[0], w2.shape[2]
    acc = acc_dtype(x_TD.dtype)
    gate_TE = torch.zeros(T, E, dtype=acc, device=x_TD.device)
    gate_TE.scatter_add_(1, topk_ids_TK.long(), topk_weights_TK.to(acc))
    if packed is not None:
        from kernels.cpu_pack import packed_linear

        gate_up_TEN = packed_linear(x_TD, packed[0]).view(T, E, 2 * inter)
        h_TEI = F.silu(gate_up_TEN[..., :inter]) * gate_up_TEN[..., inter:] * gate_TE[:, :, None]
        return packed_linear(h_TEI.reshape(T, E * inter).to(x_TD.dtype), packed[1]).to(x_TD.dtype)
    gate_up_TEN = (x_TD @ w13.reshape(E * 2 * inter, D).T).view(T, E, 2 * inter)
    h_TEI = F.silu(gate_up_TEN[..., :inter]) * gate_up_TEN[..., inter:]
    y_ETD = torch.bmm(h_TEI.transpose(0, 1), w2.transpose(1, 2))
    out_TD = torch.einsum("te,etd->td", gate_TE, y_ETD.to(acc))
    return out_TD.to(x_TD.dtype)


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `packed` argument of moe_all_experts for plain CPU weights w13 [E, 2I, D], w2 [E, D, I]."""
    from kernels.cpu_pack import pack

    E, two_i, D = w13.shape
    return pack(w13.reshape(E * two_i, D)), pack(w2.permute(1, 0, 2).reshape(D, E * (two_i // 2)))


def moe_grouped_cpu(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, counts_E: list[int] | None = None) -> torch.Tensor:
    """CPU inference, plain weights: the grouped reference's arithmetic in as few ops as it takes. The
    (token, expert) pairs are sorted by expert and their rows gathered once; each expert that got any
    pair then costs two matmuls written in place into one buffer (experts with no pair cost nothing and
    their weights are not read), and the SwiGLU, the router weights and the float32 sum (index_add) run
    once over all pairs. `counts_E` (pairs per expert, from the caller's bincount) saves recounting."""
    T, D = x_TD.shape
    K, inter = topk_ids_TK.shape[1], w2.shape[2]
    expert_P = topk_ids_TK.reshape(-1)
    if counts_E is None:
        counts_E = torch.bincount(expert_P, minlength=w13.shape[0]).tolist()
    order_P = torch.argsort(expert_P, stable=True)  # stable: a token's experts are summed in expert order
    tokens_P = order_P // K
    x_PD = x_TD.index_select(0, tokens_P)
    P = x_PD.shape[0]
    gate_up_P2I = x_TD.new_empty(P, 2 * inter)
    start = 0
    for e, n in enumerate(counts_E):
        if n:
            torch.mm(x_PD[start : start + n], w13[e].T, out=gate_up_P2I[start : start + n])
            start += n
    h_PI = F.silu(gate_up_P2I[:, :inter]).mul_(gate_up_P2I[:, inter:])
    y_PD = x_TD.new_empty(P, D)
    start = 0
    for e, n in enumerate(counts_E):
        if n:
            torch.mm(h_PI[start : start + n], w2[e].T, out=y_PD[start : start + n])
            start += n
    acc = acc_dtype(x_TD.dtype)
    weight_P1 = topk_weights_TK.reshape(-1).to(acc).index_select(0, order_P)[:, None]
    y_PD = y_PD.to(acc).mul_(weight_P1) if y_PD.dtype != acc else y_PD.mul_(weight_P1)
    out_TD = torch.zeros(T, D, dtype=acc, device=x_TD.device).index_add_(0, tokens_P, y_PD)
    return out_TD.to(x_TD.dtype)


def moe_reference_dense(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                        w13, w2) -> torch.Tensor:
    """Every expert on every token, in float32, then the routed ones picked out. For small tests only."""
    w13_ENK, w2_EDI = _as_dense(w13, torch.float32), _as_dense(w2, torch.float32)
    E, inter = w13_ENK.shape[0], w2_EDI.shape[2]
    x_TD = x_TD.to(torch.float32)
    gate_up_TEN = torch.einsum("td,end->ten", x_TD, w13_ENK)
    h_TEI = F.silu(gate_up_TEN[..., :inter]) * gate_up_TEN[..., inter:]
    y_TED = torch.einsum("tei,edi->ted", h_TEI, w2_EDI)
    gate_TE = torch.zeros(x_TD.shape[0], E, dtype=torch.float32, device=x_TD.device)
    gate_TE.scatter_add_(1, topk_ids_TK.long(), topk_weights_TK.to(torch.float32))
    return torch.einsum("te,ted->td", gate_TE, y_TED)
