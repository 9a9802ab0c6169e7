"""The decode forward of the GPU step: every sequence computes one token, with static shapes.

`decode_forward` runs the same model (the same modules and weights as `Qwen3MoeModel.forward`) for a
batch of B sequences that each compute one token, taking only fixed-shape device tensors: token ids,
positions, cache slots, block tables [B, N] and context lengths. Nothing in it depends on a value on
the host or returns a shape that depends on data, so it can be captured in a CUDA graph
(serve/engine/static_decode.py) and replayed for any batch of that size.

Per layer it is ten kernels instead of ~110 ops: the residual add fused into each RMSNorm, one q/k/v
matmul, the q/k norms, rotary and the KV-cache write in one kernel, paged decode attention reading the
cache pages in place (no gather), the o projection, the router matmul, the router's softmax/top-k/
renormalisation with the routes' record (routing replay) in one kernel, then the two MoE kernels, whose
per-pair rows the next add + RMSNorm sums over the top-k (kernels/fused.py, kernels/paged_attention.py,
kernels/moe.py). Each entry point runs its
Triton kernel on a GPU (or under TRITON_INTERPRET=1) and its torch reference elsewhere, so on a CPU
this same function runs without capture.

Numerics: the residual stream is summed in the same order and dtype as `DecoderLayer.forward`
((x + attn) + mlp, each rounded to the model dtype), norms and the router in acc_dtype, so the result
matches the eager forward up to the kernels' own reduction order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import moe_forward
from kernels.fused import add_rms_norm, apply_rope, qk_norm_rope_cache, router_topk
from kernels.paged_attention import paged_decode_attention
from serve.model import numerics
from serve.model.fp8 import FP8Linear
from serve.model.qwen3_moe import Attention, Qwen3MoeModel, SparseMoE


def prepare_for_decode(model: Qwen3MoeModel) -> None:
    """One q/k/v projection per layer (one matmul instead of three per decode step); idempotent."""
    for layer in model.layers:
        layer.self_attn.fuse_qkv()


def _attention(attn: Attention, h_BD: torch.Tensor, cos_BC, sin_BC, k_cache, v_cache, slots_B, tables_BN,
               lens_B, block_size: int, eps: float) -> torch.Tensor:
    B = h_BD.shape[0]
    q_BHC = qk_norm_rope_cache(attn.qkv_proj(h_BD), attn.q_norm.weight, attn.k_norm.weight, eps, cos_BC, sin_BC,
                               k_cache, v_cache, slots_B, attn.h)
    o_BHC = paged_decode_attention(q_BHC, k_cache, v_cache, tables_BN, lens_B, block_size, attn.c ** -0.5)
    o_BN = o_BHC.reshape(B, attn.h * attn.c)
    # an FP8 o projection hands over its split-K partials, which the next add_rms_norm adds (as the MoE's rows)
    return attn.o_proj.parts(o_BN) if isinstance(attn.o_proj, FP8Linear) else attn.o_proj(o_BN)


def _moe(moe: SparseMoE, h_BD: torch.Tensor, routes_SMK: torch.Tensor | None, slots_B: torch.Tensor) -> torch.Tensor:
    """The layer's output [B, D], or (the Triton MXFP8 kernels) its per-pair rows [B, K, D] for the next
    add_rms_norm to sum: one launch fewer."""
    record = None if routes_SMK is None else (routes_SMK, slots_B, moe.index)
    weights_BK, ids_BK = router_topk(moe.gate(h_BD), moe.top_k, moe.norm_topk, record=record)
    return moe_forward(h_BD, ids_BK, weights_BK, moe.w13, moe.w2, cpu_kernels=moe.cpu_kernels, reduce=False)


@torch.inference_mode()
def decode_forward(model: Qwen3MoeModel, ids_B: torch.Tensor, positions_B: torch.Tensor, slots_B: torch.Tensor,
                   tables_BN: torch.Tensor, lens_B: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   block_size: int, routes_SMK: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, V] (float32) of the next token of B sequences. `slots_B`: where each new token's K/V go;
    `tables_BN`/`lens_B`: each sequence's cache pages and how many cached tokens it attends to (its own
    new one included). A padding row has length 0 and a slot nobody reads. Needs `prepare_for_decode`."""
    eps = model.cfg.rms_norm_eps
    x_BD = model.embed_tokens(ids_B)
    cos_BC, sin_BC = model.cos_sin(positions_B, x_BD.dtype)
    residual_BD = None  # the residual stream; x_BD is the last block's output, not yet added to it
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        h_BD, residual_BD = add_rms_norm(x_BD, residual_BD, layer.input_layernorm.weight, eps)
        attn_BD = _attention(layer.self_attn, h_BD, cos_BC, sin_BC, k_cache, v_cache, slots_B, tables_BN, lens_B,
                             block_size, eps)
        h_BD, residual_BD = add_rms_norm(attn_BD, residual_BD, layer.post_attention_layernorm.weight, eps)
        x_BD = _moe(layer.mlp, h_BD, routes_SMK, slots_B) if isinstance(layer.mlp, SparseMoE) else layer.mlp(h_BD)
    h_BD, _ = add_rms_norm(x_BD, residual_BD, model.norm.weight, eps)
    logits_BV = F.linear(h_BD, model.embed_tokens.weight) if model.lm_head is None else model.lm_head(h_BD)
    return logits_BV.float()


def fixed_decode_forward(model: Qwen3MoeModel, ids_B: torch.Tensor, positions_B: torch.Tensor, slots_B: torch.Tensor,
                   tables_BN: torch.Tensor, lens_B: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   block_size: int, routes_SMK: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_forward`'s contract (the static decode step: fixed-shape device tensors,
    nothing read on the host, so it can be captured in a CUDA graph) for a model in the fixed mode: the
    layers' own ops in `DecoderLayer.forward`'s order, with attention reading the paged cache in place
    through the same kernel the eager path runs on gathered keys (the same arithmetic, so the same bits).
    Each row is one query with its own block table and length: a padding row (length 0) gives zeros."""
    if model.batch_invariant != "fixed":
        raise ValueError("fixed_decode_forward runs the fixed mode's kernels: set_batch_invariant('fixed') first")
    kernels = numerics._kernels()
    B = ids_B.shape[0]
    x_BD = model.embed_tokens(ids_B)
    cos_BC, sin_BC = model.cos_sin(positions_B, x_BD.dtype)
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        attn, mode = layer.self_attn, "fixed"
        h_BD = layer.input_layernorm(x_BD)
        q_BHC = attn.q_norm(numerics.proj(attn.q_proj, h_BD, mode).reshape(B, attn.h, attn.c))
        k_BGC = attn.k_norm(numerics.proj(attn.k_proj, h_BD, mode).reshape(B, attn.g, attn.c))
        v_BGC = numerics.proj(attn.v_proj, h_BD, mode).reshape(B, attn.g, attn.c)
        q_BHC, k_BGC = apply_rope(q_BHC, cos_BC, sin_BC), apply_rope(k_BGC, cos_BC, sin_BC)
        k_cache.index_copy_(0, slots_B, k_BGC.to(k_cache.dtype))
        v_cache.index_copy_(0, slots_B, v_BGC.to(v_cache.dtype))
        o_BHC = kernels.attention(q_BHC[:, None], k_cache, v_cache, lens_B[:, None], tables_BN, block_size)[:, 0]
        x_BD = x_BD + numerics.proj(attn.o_proj, o_BHC.reshape(B, attn.h * attn.c), mode)
        h_BD = layer.post_attention_layernorm(x_BD)
        if routes_SMK is not None and isinstance(layer.mlp, SparseMoE):  # routing replay: record the experts
            x_BD = x_BD + layer.mlp(h_BD, record=(routes_SMK, slots_B))
        else:
            x_BD = x_BD + layer.mlp(h_BD)
    return model.logits(model.norm(x_BD)).float()
