"""The MoE expert layer's backward pass as grouped GEMMs over the tokens sorted by expert.

Training's forward is the served kernel (kernels/moe.py's moe_forward on MXFP8 weights); its backward
is written out here rather than differentiated through a per-expert loop. With the (token, slot) pairs
sorted by expert, P = T x K of them and `offs` the end of each expert's run, every step is one grouped
GEMM whose work is proportional to the routed pairs, not to E x T:

    gate_up_P = x_P @ w13[e].T          h_P = silu(gate) * up          y_P = h_P @ w2[e].T   (recomputed)
    gy_P      = weight_P * grad[t_P]    g_weight_P = <grad[t_P], y_P>
    g_w2[e]   = gy_e.T @ h_e            gh_P = gy_P @ w2[e]
    dgu_P     = [gh * up * silu'(gate), gh * silu(gate)]
    g_w13[e]  = dgu_e.T @ x_e           g_x[t] += dgu_P @ w13[e]

`grouped_mm` is torch._grouped_mm (CUTLASS grouped GEMM on sm_90+, a fallback on CPUs) where it takes the
dtype, else a loop over the experts that got pairs (float64, older GPUs) -- the grouped reference. Sums
over a token's K slots and the router-weight products run in float32 (float64 for float64), as the forward's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe_reference import acc_dtype

_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def grouped_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch._grouped_mm runs this dtype on this device and gives the loop's results there (checked
    once per device and dtype on unaligned runs and an empty group; else the per-expert loop is used)."""
    if not hasattr(torch, "_grouped_mm") or dtype not in _GROUPED_DTYPES:
        return False
    if device.type == "cuda":
        if dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (9, 0):
            return False
    elif device.type != "cpu":
        return False
    key = (str(device), dtype)
    if key in _CHECKED:
        return _CHECKED[key]
    ok = _agrees(dtype, device)
    # under a dispatch mode (an op counter that raises at host syncs, a fake or meta mode) the check itself can
    # fail or be faked: its answer then holds for this call only, never for the rest of the process
    if not torch._C._len_torch_dispatch_stack():
        _CHECKED[key] = ok
    return ok


_CHECKED: dict[tuple[str, torch.dtype], bool] = {}


def _agrees(dtype: torch.dtype, device: torch.device) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(37, 32, generator=g, device=device).to(dtype)
    b = torch.randn(4, 48, 32, generator=g, device=device).to(dtype)  # [E, N, K], as expert weights are stored
    c = torch.randn(37, 48, generator=g, device=device).to(dtype)
    offs = torch.tensor([5, 5, 20, 37], dtype=torch.int32, device=device)
    try:
        pairs = [(grouped_mm(a, b.transpose(1, 2), offs, True), grouped_mm(a, b.transpose(1, 2), offs, False)),
                 (grouped_mm(c, b, offs, True), grouped_mm(c, b, offs, False)),
                 (grouped_wgrad(c, a, offs, True), grouped_wgrad(c, a, offs, False))]
    except RuntimeError:
        return False
    return all(torch.allclose(x.float(), y.float(), rtol=2e-2, atol=2e-2 * float(y.float().abs().max()))
               for x, y in pairs)


def _col_major(b: torch.Tensor) -> torch.Tensor:
    """b [E, K, N] stored column-major per expert (what the CUDA grouped GEMM reads); a view if it is."""
    return b if b.stride(-2) == 1 else b.transpose(-2, -1).contiguous().transpose(-2, -1)


def grouped_mm(a_PK: torch.Tensor, b_EKN: torch.Tensor, offs_E: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Rows of a in expert e's run (offs[e-1]:offs[e]) times b[e]: [P, N]."""
    if grouped:
        return torch._grouped_mm(a_PK, b_EKN if a_PK.device.type == "cpu" else _col_major(b_EKN), offs=offs_E)
    out = a_PK.new_empty(a_PK.shape[0], b_EKN.shape[-1])
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            out[start:end] = a_PK[start:end] @ b_EKN[e]
        start = end
    return out


def grouped_wgrad(a_PM: torch.Tensor, b_PN: torch.Tensor, offs_E: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Per expert a_e.T @ b_e over its run of rows: [E, M, N] (zeros for experts without pairs)."""
    if grouped:
        return torch._grouped_mm(a_PM.t(), b_PN, offs=offs_E)
    E = offs_E.numel()
    out = a_PM.new_zeros(E, a_PM.shape[1], b_PN.shape[1])
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            out[e] = a_PM[start:end].t() @ b_PN[start:end]
        start = end
    return out


def sort_pairs(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [P]: pair indices sorted by expert, stable; tokens [P]: their token; offs [E] int32: run ends)."""
    flat = topk_ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))  # bincount would sync a GPU
    offs = counts.cumsum(0, dtype=torch.int32)
    return order, order // topk_ids_TK.shape[1], offs


def _experts_on_pairs(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      grouped: bool) -> tuple[torch.Tensor, ...]:
    """The experts on the (token, slot) pairs sorted by expert: (order, tok_P, offs, x_P, gate_P, up_P,
    silu_P, h_P, y_P), each matmul in x's dtype and silu(gate) * up in x's dtype, as moe_reference."""
    inter = w2.shape[2]
    order, tok_P, offs = sort_pairs(topk_ids_TK, w13.shape[0])
    x_P = x_TD[tok_P]
    gate_up_P = grouped_mm(x_P, w13.transpose(1, 2), offs, grouped)
    gate_P, up_P = gate_up_P[:, :inter], gate_up_P[:, inter:]
    silu_P = F.silu(gate_P)
    h_P = silu_P * up_P
    y_P = grouped_mm(h_P, w2.transpose(1, 2), offs, grouped)
    return order, tok_P, offs, x_P, gate_P, up_P, silu_P, h_P, y_P


def moe_grouped_forward(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                        w13: torch.Tensor, w2: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
    """The MoE layer's forward on plain (bf16) expert weights as two grouped GEMMs over the pairs sorted by
    expert: the serving path for unquantized experts on a GPU. The rounding points are moe_reference's
    (each matmul in x's dtype, silu(gate) * up in x's dtype, the router-weighted sum in float32), and
    nothing in it waits for the host or has a data-dependent shape, so a decode step through it can be
    captured in a CUDA graph (the reference's per-expert loop cannot)."""
    if grouped is None:
        grouped = grouped_available(x_TD.dtype, x_TD.device)
    acc = acc_dtype(x_TD.dtype)
    order, tok_P, _, _, _, _, _, _, y_P = _experts_on_pairs(x_TD, topk_ids_TK, w13, w2, grouped)
    weight_P = topk_weights_TK.reshape(-1)[order].to(acc)
    out_TD = torch.zeros(x_TD.shape, dtype=acc, device=x_TD.device)
    return out_TD.index_add_(0, tok_P, y_P.to(acc) * weight_P[:, None]).to(x_TD.dtype)


BACKWARDS = ("grouped", "fused")
BACKWARD = ["grouped"]
"""The process's expert backward (the trainer sets it from TrainerConfig.expert_backward; autograd runs a
GPU's backward on its own thread, so this is a process setting, not a context): "grouped" is the one
described at the top; "fused" (moe_backward_fused) skips the recomputed y = h @ w2.T and does the SwiGLU
backward, the router weight and its gradient in one kernel (kernels/swiglu_triton.py)."""


def moe_backward(grad_TD: torch.Tensor, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 grouped: bool | None = None, variant: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (x [T, D], topk_weights [T, K], w13 [E, 2I, D], w2 [E, D, I]) of the MoE layer
    out[t] = sum_k weight[t, k] * expert_{ids[t, k]}(x[t]), with w13/w2 the (dequantized) weights in x's dtype.
    `variant`: one of BACKWARDS (default: BACKWARD[0])."""
    variant = variant or BACKWARD[0]
    if variant not in BACKWARDS:
        raise ValueError(f"expert backward must be one of {BACKWARDS}, not {variant!r}")
    if grouped is None:
        grouped = grouped_available(x_TD.dtype, x_TD.device)
    if variant == "fused":
        return moe_backward_fused(grad_TD, x_TD, topk_ids_TK, topk_weights_TK, w13, w2, grouped)
    T, K = topk_ids_TK.shape
    acc = acc_dtype(x_TD.dtype)
    order, tok_P, offs, x_P, gate, up, silu, h_P, y_P = _experts_on_pairs(x_TD, topk_ids_TK, w13, w2, grouped)
    weight_P = topk_weights_TK.reshape(-1)[order].to(acc)
    go_P = grad_TD[tok_P].to(acc)
    g_weight_P = (go_P * y_P.to(acc)).sum(-1)
    gy_P = (go_P * weight_P[:, None]).to(x_TD.dtype)
    g_w2 = grouped_wgrad(gy_P, h_P, offs, grouped)
    gh_P = grouped_mm(gy_P, w2, offs, grouped)
    sig = torch.sigmoid(gate)
    dgu_P = torch.cat([gh_P * up * (sig * (1 + gate * (1 - sig))), gh_P * silu], dim=-1)
    g_w13 = grouped_wgrad(dgu_P, x_P, offs, grouped)
    gx_P = grouped_mm(dgu_P, w13, offs, grouped)
    g_x = torch.zeros(T, x_TD.shape[1], dtype=acc, device=x_TD.device).index_add_(0, tok_P, gx_P.to(acc))
    g_weights = torch.empty(T * K, dtype=acc, device=x_TD.device).index_copy_(0, order, g_weight_P)
    return g_x.to(x_TD.dtype), g_weights.view(T, K), g_w13, g_w2


def swiglu_backward_reference(gate_up_PI2: torch.Tensor, ghu_PI: torch.Tensor, weight_P: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels/swiglu_triton.py's arithmetic in torch: (dgu [P, 2I], hw [P, I] in gate_up's dtype, g_w [P] in
    its accumulation dtype), everything computed in that dtype and rounded once."""
    acc = acc_dtype(gate_up_PI2.dtype)
    inter = gate_up_PI2.shape[1] // 2
    gate, up = gate_up_PI2[:, :inter].to(acc), gate_up_PI2[:, inter:].to(acc)
    ghu, w = ghu_PI.to(acc), weight_P.to(acc)[:, None]
    sig = torch.sigmoid(gate)
    silu = gate * sig
    h = silu * up
    gh = ghu * w
    dgu = torch.cat([gh * up * (sig * (1 + gate * (1 - sig))), gh * silu], dim=-1).to(gate_up_PI2.dtype)
    return dgu, (h * w).to(gate_up_PI2.dtype), (ghu * h).sum(-1)


def swiglu_backward(gate_up_PI2: torch.Tensor, ghu_PI: torch.Tensor, weight_P: torch.Tensor, backend: str = "auto"):
    """The Triton kernel where it runs (a GPU, or the interpreter) for bf16/fp16/fp32, else the reference."""
    from kernels.backend import use_triton

    if gate_up_PI2.dtype != torch.float64 and use_triton(gate_up_PI2.device, backend):
        from kernels.swiglu_triton import swiglu_backward_triton

        return swiglu_backward_triton(gate_up_PI2, ghu_PI, weight_P)
    return swiglu_backward_reference(gate_up_PI2, ghu_PI, weight_P)


def moe_backward_fused(grad_TD: torch.Tensor, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                       topk_weights_TK: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, grouped: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_backward with five grouped GEMMs instead of six and one elementwise kernel for the SwiGLU:

        gate_up_P = x_P @ w13[e].T (recomputed)     ghu_P = grad[t_P] @ w2[e]   (unweighted)
        dgu_P, hw_P, g_weight_P = swiglu_backward(gate_up_P, ghu_P, weight_P)
        g_w2[e] = grad_e.T @ hw_e     g_w13[e] = dgu_e.T @ x_e     g_x[t] += dgu_P @ w13[e]

    g_weight = <grad, h @ w2.T> is taken as <grad @ w2, h>, so y is never recomputed, and the gradient rows
    are gathered in x's dtype (no float32 copies of [P, D]). Not bitwise the grouped variant: the SwiGLU's
    products are rounded once (float32 inside), and the router weight multiplies h instead of the gradient
    for g_w2; tests/kernels/test_moe_grouped.py holds both to autograd through the reference."""
    T, K = topk_ids_TK.shape
    acc = acc_dtype(x_TD.dtype)
    order, tok_P, offs = sort_pairs(topk_ids_TK, w13.shape[0])
    x_P = x_TD[tok_P]
    gate_up_P = grouped_mm(x_P, w13.transpose(1, 2), offs, grouped)
    go_P = grad_TD.to(x_TD.dtype)[tok_P]
    ghu_P = grouped_mm(go_P, w2, offs, grouped)
    weight_P = topk_weights_TK.reshape(-1)[order]
    dgu_P, hw_P, g_weight_P = swiglu_backward(gate_up_P, ghu_P, weight_P)
    g_w2 = grouped_wgrad(go_P, hw_P, offs, grouped)
    g_w13 = grouped_wgrad(dgu_P, x_P, offs, grouped)
    gx_P = grouped_mm(dgu_P, w13, offs, grouped)
    g_x = torch.zeros(T, x_TD.shape[1], dtype=acc, device=x_TD.device).index_add_(0, tok_P, gx_P.to(acc))
    g_weights = torch.empty(T * K, dtype=acc, device=x_TD.device).index_copy_(0, order, g_weight_P.to(acc))
    return g_x.to(x_TD.dtype), g_weights.view(T, K), g_w13, g_w2
