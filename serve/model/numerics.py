"""Batch-invariant numerics: a token's results depend on its own inputs only, not on the rest of the batch.

Why: the default kernels (oneDNN/MKL/cuBLAS matmuls, SDPA's flash attention, torch's vectorised
reductions) sum in float32 in an order that depends on the shapes they are handed. One row of a
[1, D] x [D, N] product and the same row inside an [L, D] x [D, N] product can differ in the last
float32 bits, which is often enough one bfloat16 ulp, and a few layers later a log-prob moves by 1e-2.
So the server's decode step, its chunked prefill and the trainer's whole-sequence forward disagree
although they compute the same function.

Two modes (`MODES`), chosen once by `resolve_mode` for server and trainer alike:
- "fixed" (the default on a GPU): every reduction runs in a fixed order in the model's dtype with float32
  accumulation, through kernels/batch_invariant_triton.py: matmuls with fixed tiles and no split-K
  (the experts through the same matmul, their weighted sum in slot order), per-row RMSNorm and softmax,
  attention over keys cut into the same fixed KV blocks from key 0 for decode, prefill and the trainer.
  Static shapes and no host sync, so the kernels can live in CUDA graphs. On a CPU they need the Triton
  interpreter (tests). The trainer's forward runs the same kernels; its backward goes through torch
  references (kernels/batch_invariant.py): only the forward's bits must match the server's.
- "float64" (the default on a CPU, where it is the cheap exact route): every reduction (matmuls,
  attention, norms, softmax, the experts' weighted sum) and every transcendental (exp, silu, rsqrt,
  cos/sin) runs in float64, and the result is rounded to the model's dtype at the same points where the
  default path rounds. Products of bfloat16, float16 or float32 values are exact in float64 (8 + 8,
  11 + 11, 24 + 24 significant bits <= 53), and their sums stay exact over the ranges a model produces, so
  a sum does not depend on the order it was taken in. Where float64 does round (exp, terms 2^53 times
  smaller than the sum), the results differ by ~2^-52 relative, which the final rounding to the model's
  dtype erases except with probability ~1e-13 per value.
Either way one token's logits are the same bits alone or in any batch, in one prefill or in chunks or
decoded step by step, and whether the server or the trainer computes them: its log-probs are a function
of the token ids (vLLM's and SGLang's batch-invariant modes, and Thinking Machines' batch_invariant_ops,
use fixed-order kernels as the fixed mode does).

Both modes keep rotary cos/sin in float64 (a [T, C] elementwise op: vectorised and scalar float32 cos
differ in the last bit) and the final log-softmax in torch's per-row float32 kernel on both sides.
Cost: float64 matmuls are a few times slower than bfloat16 on a CPU and far slower on most GPUs
(bench/train_serve_gap.py measures the CPU); the fixed mode's cost against the default on a GPU is
bench/gpu.py's `invariant` section. Limits: a float64 model is not made invariant by the float64 mode
(there is nothing wider to sum in); the elementwise ops that stay in the model's dtype (residual adds,
rotary, the norm's weight) are correctly rounded and so already invariant. The fixed mode's attention
reads only how many keys each query may see (the masks the model passes are prefixes).
"""

from __future__ import annotations

from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import batch_invariant as reference
from kernels.backend import why_not_triton
from kernels.fused import rms_norm as _rms_norm
from kernels.moe import FEW_ROWS_F64
from kernels.moe_reference import moe_reference

WIDE = torch.float64
MODES = ("fixed", "float64")


def resolve_mode(requested: bool | str | None, device: torch.device | str) -> str | None:
    """The one definition of which numerics a model runs (server and trainer both call it): None (off),
    "fixed" or "float64". True or "auto": "fixed" on a GPU, "float64" elsewhere (the fixed kernels need
    Triton; a CPU has them only under the interpreter)."""
    if requested in (False, None, "", "off"):
        return None
    kind = torch.device(device).type
    if requested in (True, "auto"):
        return "fixed" if kind == "cuda" and why_not_triton(torch.device(kind)) is None else "float64"
    if requested not in MODES:
        raise ValueError(f"batch-invariant mode must be one of {', '.join(MODES)} (or auto), not {requested!r}")
    if requested == "fixed" and (why := why_not_triton(torch.device(kind))):
        raise ValueError(f"batch-invariant mode 'fixed' runs Triton kernels, which cannot run here ({why}); "
                         "the 'float64' mode runs anywhere")
    return requested


def _kernels():
    from kernels import batch_invariant_triton

    return batch_invariant_triton


class _Fixed(torch.autograd.Function):
    """Forward through a fixed-order kernel, backward through its torch reference (recomputed)."""

    @staticmethod
    def forward(ctx, kernel, ref, *args):
        ctx.ref, ctx.args = ref, args
        return kernel(*args)

    @staticmethod
    def backward(ctx, grad):
        need = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            args = [a.detach().requires_grad_() if n else a for a, n in zip(ctx.args, need, strict=True)]
            wrt = [a for a, n in zip(args, need, strict=True) if n]
            grads = iter(torch.autograd.grad(ctx.ref(*args), wrt, grad, allow_unused=True))
        return (None, None, *(next(grads) if n else None for n in need))


def _fixed(name: str, *args, **kw):
    """kernels/batch_invariant_triton.py's `name`; differentiable (through the reference) when needed."""
    kernel, ref = partial(getattr(_kernels(), name), **kw), partial(getattr(reference, name), **kw)
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return _Fixed.apply(kernel, ref, *args)
    return kernel(*args)


def _mode(exact: bool | str) -> str:
    return "float64" if exact is True else exact


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, mode: bool | str = "float64") -> torch.Tensor:
    """x @ w.T (+ b), rounded once to x's dtype (as a bf16 GEMM with float32 accumulation rounds its
    output): summed exactly (float64) or in the fixed order (fixed)."""
    if _mode(mode) == "fixed":
        return _fixed("matmul", x, w, b)
    return F.linear(x.to(WIDE), w.to(WIDE), None if b is None else b.to(WIDE)).to(x.dtype)


def proj(m: torch.nn.Linear, x: torch.Tensor, exact: bool | str | None, kernels: ModuleType | None = None) -> torch.Tensor:
    """A linear layer's forward: in the batch-invariant mode `exact` names, or the module's own. `kernels`:
    the C++ kernels, given where pack_for_cpu found the weight fit for their linear_f64 (`linear_f64_takes`):
    1-16 rows (a decode, a verified draft) go through it (kernels/csrc/linear_f64_cpu.cpp: with the LM
    head, 0.91-0.96x a step of the built-in model at 1-9 rows; a row's result does not depend on the
    others). Else 2-16 rows on a CPU through `by_weight`: cold, a [256, 128] float64 weight took 41 -> 21
    us at 2 rows, 47 -> 29 at 5, 53 -> 42 at 9 on the VM of 2026-11-29's morning (BENCHMARKS, speculative
    decoding); one row keeps F.linear."""
    if exact:
        return linear(x, m.weight, m.bias, exact)
    if kernels is not None and few_rows(x):
        return kernels.linear_f64(x.contiguous(), m.weight)
    if x.dim() == 2 and 2 <= x.shape[0] <= 16 and x.device.type == "cpu" \
            and x.dtype in (torch.float32, torch.float64) and type(m) is torch.nn.Linear and m.bias is None \
            and x.dtype == m.weight.dtype and not torch.is_grad_enabled():
        return by_weight(m.weight, x).contiguous()
    return m(x)


def linear_f64_takes(m: torch.nn.Linear | torch.nn.Embedding) -> bool:
    """Whether the C++ kernels' linear_f64 can take this layer's x·wᵀ: a plain float64 CPU weight, contiguous,
    no bias, sizes multiples of 8. Checked once, by pack_for_cpu (a step asks ~13 times: ~4 us each when
    checked per call); a call then checks only its rows (`few_rows`)."""
    w = m.weight
    return (type(m) in (torch.nn.Linear, torch.nn.Embedding) and getattr(m, "bias", None) is None
            and w.dtype == torch.float64 and w.device.type == "cpu" and w.is_contiguous()
            and w.shape[0] % 8 == 0 and w.shape[1] % 8 == 0)


def few_rows(x: torch.Tensor) -> bool:
    """Rows the float64 C++ kernels take (FEW_ROWS_F64 at most: a decode, a verified draft), in inference."""
    return x.dim() == 2 and x.shape[0] <= FEW_ROWS_F64 and not torch.is_grad_enabled()


def by_weight(w_ND: torch.Tensor, x_RD: torch.Tensor) -> torch.Tensor:
    """x·wᵀ [R, N] computed as w·xᵀ (a transposed view): one GEMM with the weight's rows as its long side, a
    single row doubled to make it one. On a CPU, MKL's GEMV and its small-M GEMM on the transposed weight
    (what F.linear runs) read the weight at half the speed or less: the LM head, cold, one thread, 1.8x
    faster at 1 row, 2.4-5x at 2. Same products, another summation order."""
    n = x_RD.shape[0]
    return torch.mm(w_ND, (x_RD if n != 1 else x_RD.expand(2, -1).contiguous()).T)[:, :n].T



def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, mode: bool | str = "float64") -> torch.Tensor:
    """RMSNorm as kernels.fused.rms_norm rounds it, the mean square in float64 or per row in fixed order."""
    if _mode(mode) == "fixed":
        return _fixed("rms_norm", x, w, eps=eps)
    return _rms_norm(x, w, eps, WIDE)


def silu_mul(g: torch.Tensor, u: torch.Tensor, mode: bool | str = "float64") -> torch.Tensor:
    """SwiGLU's silu(g) * u, silu rounded to g's dtype."""
    if _mode(mode) == "fixed":
        return _fixed("silu_mul", g, u)
    return F.silu(g.to(WIDE)).to(g.dtype) * u


def router_probs(logits_TE: torch.Tensor, mode: bool | str = "float64") -> torch.Tensor:
    """softmax over the experts: float64, or float32 from the per-row log-softmax kernel."""
    if _mode(mode) == "fixed":
        return _fixed("log_softmax", logits_TE).exp()
    return torch.softmax(logits_TE, dim=-1, dtype=WIDE)


def topk_sum(w_TK: torch.Tensor, mode: bool | str = "float64") -> torch.Tensor:
    """[T, 1]: the top-k weights' sum. Fixed: one add at a time in slot order (torch's sum over a short last
    dim vectorises across rows or within one row depending on the row count)."""
    if _mode(mode) != "fixed":
        return w_TK.sum(dim=-1, keepdim=True)
    total = w_TK[:, :1]
    for k in range(1, w_TK.shape[1]):
        total = total + w_TK[:, k:k + 1]
    return total


def attention(q_BHQC: torch.Tensor, k_BGLC: torch.Tensor, v_BGLC: torch.Tensor,
              allowed_BQL: torch.Tensor, mode: bool | str = "float64") -> torch.Tensor:
    """softmax(q k^T / sqrt(C)) v over the keys `allowed_BQL` lets each query see (bool, broadcast over
    heads; a prefix of the keys for every query), rounded once to q's dtype: [B, H, Q, C]. Grouped-query
    heads share their kv head. float64 sums, or the fixed-block kernel (which reads each query's count)."""
    if _mode(mode) == "fixed":
        B, _, Q, _ = q_BHQC.shape
        lens_BQ = allowed_BQL.sum(-1, dtype=torch.int32).expand(B, Q)
        return _fixed("attention", q_BHQC.transpose(1, 2), k_BGLC, v_BGLC, lens_BQ).transpose(1, 2)
    dtype, H, G = q_BHQC.dtype, q_BHQC.shape[1], k_BGLC.shape[1]
    k, v = k_BGLC.to(WIDE), v_BGLC.to(WIDE)
    if H != G:
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    scores = (q_BHQC.to(WIDE) @ k.transpose(-1, -2)) * q_BHQC.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed_BQL[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(dtype)


def causal(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """[1, Q, L] True where query i (the last q_len of ctx_len positions) may see key j."""
    rows = torch.arange(q_len, device=device)[:, None] + (ctx_len - q_len)
    return (torch.arange(ctx_len, device=device)[None, :] <= rows)[None]


def moe(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, w13, w2,
        mode: bool | str = "float64") -> torch.Tensor:
    """The expert layer. float64: kernels/moe_reference.py's grouped reference in its `exact` mode
    (gate/up and down projections rounded to x's dtype as the default path rounds them, silu and the
    router-weighted sum in float64). fixed: kernels/batch_invariant_triton.py's moe (plain or MXFP8
    weights). Differentiable (training with plain or fake-quantized masters)."""
    if _mode(mode) == "fixed":
        return _fixed("moe", x_TD, ids_TK, weights_TK, w13, w2)
    return moe_reference(x_TD, ids_TK, weights_TK, w13, w2, exact=True)
