"""bench/gpu.py's `fp8` section: FP8 dense layers (`--quant-dense fp8`, issue 51 item 3) at the Qwen3-30B-A3B shape.

Two measurements, side by side with bf16 in the same run:
- kernels: kernels/fp8_linear_triton.py (W8A16, block-FP8 weights) against bf16 F.linear (cuBLAS) for the
  dense layers of a step: q/k/v fused [5120, 2048], o [2048, 4096], LM head [151936, 2048], at decode rows
  (1..64: batch or speculative verification) and a prefill chunk; ms, weight GB/s and % of copy bandwidth
  (a decode GEMV is bound by reading its weight), and the kernel's max relative error against the torch
  reference on the same FP8 weights.
- engines: two dummy-weight engines (the same random weights: serve/model/dummy.py draws them from a fixed
  seed), MXFP8 experts, `quant_dense` none and fp8: the logits along one forced sequence (max and mean
  |d logit|, greedy agreement over its positions) and decode steps at batch 1/8/32. Random weights say how
  much FP8 rounding moves logits of a model this shape, not how a trained model's answers change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8_block import fp8_linear, fp8_linear_reference, quantize_block_fp8


def dense_shapes(shape: dict) -> list[tuple[str, int, int]]:
    """(name, N, K) of the dense layers one decode step reads: q/k/v fused, o, the LM head."""
    D, h, g, c = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    return [("qkv", (h + 2 * g) * c, D), ("o", D, h * c), ("lm_head", shape["vocab_size"], D)]


def kernel_rows(shape: dict, rows: list[int], device: torch.device, timed, copy_bw: float, left) -> list[dict]:
    """One row per (layer, M): bf16 F.linear vs fp8_linear (the Triton kernel on a GPU, the torch reference on a
    CPU). `timed(fn)` -> median seconds; `left()` -> seconds of budget left."""
    out = []
    for name, N, K in dense_shapes(shape):
        w = (torch.randn(N, K, device=device) * 0.02).to(torch.bfloat16)
        data, scale_inv = quantize_block_fp8(w)
        for M in rows:
            if left() < 2:
                break
            x = torch.randn(M, K, device=device).to(torch.bfloat16)
            t16 = timed(lambda x=x, w=w: F.linear(x, w))
            t8 = timed(lambda x=x, d=data, s=scale_inv: fp8_linear(x, d, s))
            ref = fp8_linear_reference(x.float(), data, scale_inv)
            got = fp8_linear(x, data, scale_inv).float()
            err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
            b16, b8 = N * K * 2, N * K + scale_inv.numel() * 4
            out.append({"kind": "kernel", "layer": name, "N": N, "K": K, "M": M, "bf16_ms": t16 * 1e3,
                        "fp8_ms": t8 * 1e3, "speedup": t16 / t8, "fp8_gb_s": b8 / t8 / 1e9,
                        "fp8_pct_copy": 100 * b8 / t8 / copy_bw, "bf16_pct_copy": 100 * b16 / t16 / copy_bw,
                        "max_rel_err": err})
        w = data = scale_inv = None
    return out


def logit_gap(base: torch.Tensor, fp8: torch.Tensor) -> dict:
    """base, fp8: logits [P, V] along the same forced positions."""
    d = (fp8.float() - base.float()).abs()
    return {"kind": "logit_gap", "positions": base.shape[0], "max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "logit_std": float(base.float().std()),
            "greedy_agree": float((fp8.argmax(-1) == base.argmax(-1)).float().mean())}
