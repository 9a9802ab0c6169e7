"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B and friends) over flattened token batches.

A step's tokens from all sequences are concatenated ([T]); attention finds each sequence's keys in
the paged KV cache through AttnMeta. The experts go through one seam, `kernels.moe_forward`, which
takes plain weights (the bf16/fp32 reference) or MXFP8Tensor weights (the Triton kernels). Logits are
computed only for the rows that will be sampled. On a CPU with our kernels built, a step where every row
decodes runs all the layers in one C++ call (`decode_plan`; kernels/csrc/decode_layers_cpu.cpp), op for
op what the layers' forwards do, without the interpreter between ops.

`forward_train` is the same model without the paged cache, for the RL trainer: right-padded
sequences [B, L] from position 0, causal SDPA, gradients on. Same modules, same weights, so at equal
weights the trainer's log-probs equal the sampler's. For training, `to_training()` turns the expert
tensors into Parameters (fp32/bf16 masters); with `train_mxfp8` set they run through
`kernels.mxfp8_moe`, whose forward is the served MXFP8 path on freshly quantized masters.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import MXFP8Tensor, cpu_pack, moe_forward
from kernels.fused import add_rms_norm, qk_norm_rope_cache
from kernels.lm_head import chunked_logprobs
from kernels.moe import block_experts, blocked
from kernels.moe_reference import acc_dtype
from kernels.mxfp8_linear import QuantCache, fake_quantize_mxfp8, mxfp8_moe
from serve.model import numerics
from serve.model.config import ModelConfig
from serve.model.layers import AttnMeta, RMSNorm, Rotary, apply_rope, attention, paged_attention
from serve.model.numerics import WIDE, by_weight, proj


def _fused_backend(x: torch.Tensor) -> str:
    """kernels/fused.py's Triton kernels on a GPU; on a CPU their torch references (the model's own ops), never
    the Triton interpreter a test session may have switched on (slow, and not the CPU server's arithmetic)."""
    return "auto" if x.is_cuda else "torch"


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.g, self.c = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.c, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.g * self.c, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.g * self.c, bias=bias)
        self.o_proj = nn.Linear(self.h * self.c, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.c, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.c, cfg.rms_norm_eps)
        self.qkv_proj: nn.Linear | None = None  # see fuse_qkv
        self.exact: bool | str = False  # batch-invariant numerics' mode (serve/model/numerics.py)
        self.f64_kernels: ModuleType | None = None  # for qkv_proj and o_proj's linear_f64 (numerics.proj): pack_for_cpu

    def fuse_qkv(self) -> None:
        """Inference only: q, k and v projections as one linear layer (two fewer matmuls per layer and
        step, which a CPU decode step is bound by); the separate ones are dropped, so no extra memory."""
        if self.qkv_proj is not None:
            return
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        fused = nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features, bias=q.bias is not None,
                          device=q.weight.device, dtype=q.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            if q.bias is not None:
                fused.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x_TD, cos_TC, sin_TC, k_cache, v_cache, meta: AttnMeta) -> torch.Tensor:
        T = x_TD.shape[0]
        if self.qkv_proj is not None and meta.cpu_kernels is not None:  # CPU: norms, rope, cache write in C++
            q_THC = meta.cpu_kernels.attention_prologue(
                self.qkv_proj(x_TD), self.q_norm.weight.float(), self.k_norm.weight.float(), self.q_norm.eps,
                cos_TC.contiguous(), sin_TC.contiguous(), k_cache, v_cache, meta.slot_mapping_T, self.h)
            o_THC = paged_attention(q_THC, k_cache, v_cache, meta, self.g)
            return self.o_proj(o_THC.reshape(T, self.h * self.c))
        if self.qkv_proj is not None:  # inference (a GPU, or a CPU without our kernels): one q/k/v matmul, then
            # q/k norms, rotary and the cache write in one kernel on a GPU; elsewhere its reference, the ops below
            qkv_TN = proj(self.qkv_proj, x_TD, self.exact, self.f64_kernels)
            q_THC = qk_norm_rope_cache(qkv_TN, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                       cos_TC, sin_TC, k_cache, v_cache, meta.slot_mapping_T, self.h,
                                       backend=_fused_backend(x_TD))
            o_THC = paged_attention(q_THC, k_cache, v_cache, meta, self.g, self.exact)
            return proj(self.o_proj, o_THC.reshape(T, self.h * self.c), self.exact, self.f64_kernels)
        q_TN, k_TN, v_TN = (proj(m, x_TD, self.exact) for m in (self.q_proj, self.k_proj, self.v_proj))
        q_THC = self.q_norm(q_TN.reshape(T, self.h, self.c))
        k_TGC = self.k_norm(k_TN.reshape(T, self.g, self.c))
        v_TGC = v_TN.reshape(T, self.g, self.c)
        q_THC, k_TGC = apply_rope(q_THC, cos_TC, sin_TC), apply_rope(k_TGC, cos_TC, sin_TC)
        k_cache.index_copy_(0, meta.slot_mapping_T, k_TGC.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping_T, v_TGC.to(v_cache.dtype))
        o_THC = paged_attention(q_THC, k_cache, v_cache, meta, self.g, self.exact)
        return proj(self.o_proj, o_THC.reshape(T, self.h * self.c), self.exact)

    def forward_dense(self, x_BLD: torch.Tensor, cos_LC: torch.Tensor, sin_LC: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over whole right-padded sequences (no cache): the training forward."""
        B, L, _ = x_BLD.shape
        q_BLHC = self.q_norm(proj(self.q_proj, x_BLD, self.exact).view(B, L, self.h, self.c))
        k_BLGC = self.k_norm(proj(self.k_proj, x_BLD, self.exact).view(B, L, self.g, self.c))
        v_BLGC = proj(self.v_proj, x_BLD, self.exact).view(B, L, self.g, self.c)
        q_BLHC, k_BLGC = apply_rope(q_BLHC, cos_LC, sin_LC), apply_rope(k_BLGC, cos_LC, sin_LC)
        q_BHLC, k_BGLC, v_BGLC = q_BLHC.transpose(1, 2), k_BLGC.transpose(1, 2), v_BLGC.transpose(1, 2)
        if self.exact:
            o_BHLC = numerics.attention(q_BHLC, k_BGLC, v_BGLC, numerics.causal(L, L, x_BLD.device), self.exact)
        else:  # the kernel the server's prefill takes
            o_BHLC = attention(q_BHLC, k_BGLC, v_BGLC)
        return proj(self.o_proj, o_BHLC.transpose(1, 2).reshape(B, L, self.h * self.c), self.exact)


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.exact: bool | str = False  # batch-invariant numerics' mode (serve/model/numerics.py)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.exact:
            g_TI, u_TI = proj(self.gate_proj, x_TD, self.exact), proj(self.up_proj, x_TD, self.exact)
            return proj(self.down_proj, numerics.silu_mul(g_TI, u_TI, self.exact), self.exact)
        return self.down_proj(F.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD))


class SparseMoE(nn.Module):
    """Router + experts. Expert weights live as attributes (not Parameters) so that they can be swapped
    for MXFP8Tensor at load time: w13 = gate_up_proj [E, 2I, D], w2 = down_proj [E, D, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.w13: torch.Tensor | MXFP8Tensor = torch.empty(0)
        self.w2: torch.Tensor | MXFP8Tensor = torch.empty(0)
        self.train_mxfp8 = False  # training: experts through the MXFP8 straight-through path
        self.quant_cache: QuantCache | None = None  # training: the masters' MXFP8 copy, once per optimizer step
        self.cpu_kernels: ModuleType | None = None  # inference on a CPU: kernels/cpu_ext.py (pack_for_cpu)
        self.gate_kernels: ModuleType | None = None  # for the router's linear_f64 (numerics.proj): pack_for_cpu
        self.index = 0  # among the model's MoE layers (the M of routes [T, M, K])
        self.replay_counts: torch.Tensor | None = None  # [rows replayed, of those with other experts]
        self.exact: bool | str = False  # batch-invariant numerics' mode (serve/model/numerics.py)

    def forward(self, x_TD: torch.Tensor, replay_TK: torch.Tensor | None = None,
                record: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`replay_TK`: experts to use instead of the router's top-k (training on what the server routed;
        rows with a -1 keep the router's own choice), weighted by the router's probabilities of those
        experts, so the router still learns. `record` (routes_SMK, slots_T): store each token's experts."""
        logits_TE = proj(self.gate, x_TD, self.exact, self.gate_kernels)
        probs_TE = (numerics.router_probs(logits_TE, self.exact) if self.exact
                    else torch.softmax(logits_TE, dim=-1, dtype=acc_dtype(logits_TE.dtype)))
        weights_TK, ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if replay_TK is not None:
            ids_TK = self._replay(ids_TK, replay_TK.to(ids_TK.device))
            weights_TK = probs_TE.gather(-1, ids_TK)
        if record is not None:
            routes_SMK, slots_T = record
            routes_SMK[slots_T, self.index] = ids_TK.to(routes_SMK.dtype)
        if self.norm_topk:
            weights_TK = weights_TK / (numerics.topk_sum(weights_TK, self.exact) if self.exact
                                       else weights_TK.sum(dim=-1, keepdim=True))
        weights_TK = weights_TK.to(logits_TE.dtype)
        if self.exact:  # training: the masters through the MXFP8 round trip, as saved and served
            w13, w2 = ((fake_quantize_mxfp8(w) for w in (self.w13, self.w2)) if self.train_mxfp8
                       else (self.w13, self.w2))
            return numerics.moe(x_TD, ids_TK, weights_TK, w13, w2, self.exact)
        if self.train_mxfp8:
            return mxfp8_moe(x_TD, ids_TK, weights_TK, self.w13, self.w2, cache=self.quant_cache)
        return moe_forward(x_TD, ids_TK, weights_TK, self.w13, self.w2, cpu_kernels=self.cpu_kernels)

    def _replay(self, own_TK: torch.Tensor, replay_TK: torch.Tensor) -> torch.Tensor:
        """The replayed experts where a row has them; counts rows replayed and rows whose expert set
        differs from the router's own into `replay_counts` (the trainer reports them)."""
        replay_TK = replay_TK.long()
        has_T1 = (replay_TK >= 0).all(-1, keepdim=True)
        if not _RECOMPUTING[0]:  # an activation-checkpointed layer's second forward counts nothing
            differs_T = (own_TK.sort(-1).values != replay_TK.sort(-1).values).any(-1) & has_T1[:, 0]
            n = torch.stack([has_T1.sum(), differs_T.sum()])
            self.replay_counts = n if self.replay_counts is None else self.replay_counts + n
        return torch.where(has_T1, replay_TK, own_TK)


_RECOMPUTING = [False]


@contextlib.contextmanager
def _recomputing():
    _RECOMPUTING[0] = True
    try:
        yield
    finally:
        _RECOMPUTING[0] = False


class _Call(nn.Module):
    """fn(module) as a module's forward, so torch.func.functional_call can swap the module's tensors for it."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, fn):
        return fn(self.m)


def in_dtype(module: nn.Module, dtype: torch.dtype, fn):
    """fn(module) with the module's floating parameters replaced by differentiable copies in `dtype`
    (gradients reach the masters), except MXFP8 experts' masters, which their forward quantizes itself.
    The trainer runs its forward so (float32 masters, bf16 compute), and an activation-checkpointed layer
    runs its recomputation so: the copies exist only during the forward, and the backward's rerun must
    cast the masters as the forward saw them or it rebuilds another graph (torch refuses it)."""
    keep = {id(w) for m in module.modules() if isinstance(m, SparseMoE) and m.train_mxfp8 for w in (m.w13, m.w2)}
    cast = {f"m.{n}": p.to(dtype) for n, p in module.named_parameters()
            if id(p) not in keep and p.is_floating_point() and p.dtype != dtype}
    if not cast:
        return fn(module)
    return torch.func.functional_call(_Call(module), cast, (fn,), strict=False, tie_weights=True)


def _forward_dense_in_dtype(layer: DecoderLayer, x_BLD, cos_LC, sin_LC, routes_BLMK) -> torch.Tensor:
    """What an activation-checkpointed layer runs: forward_dense with its tensors in x's dtype (in the
    forward itself they already are, and nothing is cast)."""
    return in_dtype(layer, x_BLD.dtype, lambda m: m.forward_dense(x_BLD, cos_LC, sin_LC, routes_BLMK))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp: nn.Module = SparseMoE(cfg) if cfg.is_moe_layer(index) else DenseMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_TD, cos_TC, sin_TC, k_cache, v_cache, meta: AttnMeta) -> torch.Tensor:
        attn_TD = self.self_attn(self.input_layernorm(x_TD), cos_TC, sin_TC, k_cache, v_cache, meta)
        norm = self.post_attention_layernorm
        if norm.exact:
            x_TD = x_TD + attn_TD
            h_TD = norm(x_TD)
        else:  # the residual add and the norm: one kernel on a GPU, the same ops elsewhere (x + a == a + x)
            h_TD, x_TD = add_rms_norm(attn_TD, x_TD, norm.weight, norm.eps, backend=_fused_backend(x_TD))
        if meta.routes_SMK is not None and isinstance(self.mlp, SparseMoE):
            return x_TD + self.mlp(h_TD, record=(meta.routes_SMK, meta.slot_mapping_T))
        return x_TD + self.mlp(h_TD)

    def forward_dense(self, x_BLD, cos_LC, sin_LC, routes_BLMK: torch.Tensor | None = None) -> torch.Tensor:
        """`routes_BLMK`: the experts to replay (see SparseMoE.forward), all MoE layers'."""
        x_BLD = x_BLD + self.self_attn.forward_dense(self.input_layernorm(x_BLD), cos_LC, sin_LC)
        h_TD = self.post_attention_layernorm(x_BLD).reshape(-1, x_BLD.shape[-1])
        if routes_BLMK is not None and isinstance(self.mlp, SparseMoE):
            replay_TK = routes_BLMK[:, :, self.mlp.index].reshape(h_TD.shape[0], -1)
            return x_BLD + self.mlp(h_TD, replay_TK=replay_TK).view_as(x_BLD)
        return x_BLD + self.mlp(h_TD).view_as(x_BLD)


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: Rotary | None = None
        # CPU decode steps through kernels/cpu_ext.py's decode_layers when it covers the model (decode_plan);
        # False: every layer's Python forward (the same result; for profiling layer by layer)
        self.fused_decode = True
        self.batch_invariant = False  # see set_batch_invariant
        self.f64_kernels: ModuleType | None = None  # for the LM head's linear_f64: pack_for_cpu
        self.activation_checkpointing = False  # training: keep each layer's input only, recompute the rest
        for i, moe in enumerate(self.moe_layers()):
            moe.index = i

    def set_batch_invariant(self, on: bool | str = True) -> Qwen3MoeModel:
        """Batch-invariant numerics (serve/model/numerics.py) in every layer: a token's logits become a
        function of the token ids before it, the same bits in any batch or step split, on the server and in
        the trainer. `on`: True/"auto" (the device's default mode), "fixed", "float64", or False. Needs the
        plain layout (not pack_for_cpu's) and the torch paths. Returns self."""
        mode = numerics.resolve_mode(on, self.embed_tokens.weight.device)
        if mode and any(layer.self_attn.qkv_proj is not None for layer in self.layers):
            raise ValueError("batch-invariant numerics need the plain weight layout: set them before pack_for_cpu")
        self.batch_invariant = mode or False
        for m in self.modules():
            if hasattr(m, "exact"):
                m.exact = mode or False
        return self

    def cos_sin(self, positions_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos and sin [T, C] at these positions; the table is made on their device at first use."""
        if self.rotary is None:
            self.rotary = Rotary(self.cfg, positions_T.device)
        return self.rotary.cos_sin(positions_T, dtype, WIDE if self.batch_invariant else None)

    def logits(self, h_ND: torch.Tensor) -> torch.Tensor:
        """The LM head (tied to the embeddings or not) on final-norm hidden states, in their dtype.

        Served on a CPU (an unpacked head: float64, or tied), a step's rows go through it as one GEMM with
        the vocabulary as its long side (numerics.by_weight): F.linear read the [V, D] weight at half the
        speed or less (a cold head, one thread: 1.8x at 1 row, 2.4-5x at 2, 1.2-2.2x at 5), so a verify step
        of 2-9 rows paid up to twice a decode's head. A step of the built-in model: 0.94x the time at 1 row,
        0.87-0.90x at 2-3, 0.94x at 5 (BENCHMARKS, speculative decoding). |Δ logit| ~1e-14 in float64.
        In float64 with the C++ kernels (`f64_kernels`), 1-16 rows go through their linear_f64 instead:
        0.96-0.98x a step at 1-9 rows, and a row's logits do not depend on the step's other rows."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        if self.f64_kernels is not None and not self.batch_invariant and numerics.few_rows(h_ND):
            return self.f64_kernels.linear_f64(h_ND.contiguous(), head.weight)
        if not self.batch_invariant and h_ND.dim() == 2 and h_ND.device.type == "cpu" and \
                not torch.is_grad_enabled() and (self.lm_head is None or type(self.lm_head) is nn.Linear
                                                 and self.lm_head.bias is None):
            return by_weight(head.weight, h_ND)
        if self.lm_head is not None:
            return proj(self.lm_head, h_ND, self.batch_invariant)
        w = self.embed_tokens.weight
        return numerics.linear(h_ND, w, mode=self.batch_invariant) if self.batch_invariant else F.linear(h_ND, w)

    def target_logprobs(self, input_ids_BL: torch.Tensor, sel_BT: torch.Tensor, chunk: int,
                        routes_BLMK: torch.Tensor | None = None) -> torch.Tensor:
        """Training: log-prob [N] of token t+1 at each selected position t (`sel_BT` [B, L-1]), the LM head
        and log-softmax taken `chunk` vocabulary rows at a time (kernels/lm_head.py): never [N, V]."""
        h_ND = self.hidden_train(input_ids_BL, routes_BLMK)[:, :-1][sel_BT]
        w_VD = self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight
        return chunked_logprobs(h_ND, w_VD, input_ids_BL[:, 1:][sel_BT], chunk)

    def moe_layers(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    @torch.inference_mode()
    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, meta: AttnMeta,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_rows_B: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] (float32) for the rows in `logits_rows_B`."""
        x_TD = self.embed_tokens(input_ids_T)
        cos_TC, sin_TC = self.cos_sin(positions_T, x_TD.dtype)
        plan = None if meta.prefill else self.decode_plan(meta.cpu_kernels)
        if plan is not None and meta.decode_rows_B.numel() == x_TD.shape[0]:  # every row decodes: one C++ call
            x_TD = meta.cpu_kernels.decode_layers(
                x_TD, *plan, [k for k, _ in kv_caches], [v for _, v in kv_caches], cos_TC.contiguous(),
                sin_TC.contiguous(), meta.slot_mapping_T, meta.decode_tables_BN, meta.decode_lens_B, meta.routes_SMK,
                self.cfg.rms_norm_eps, self.cfg.num_attention_heads, self.cfg.num_experts_per_tok,
                self.cfg.norm_topk_prob, self.cfg.head_dim**-0.5, meta.block_size)
        else:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
                x_TD = layer(x_TD, cos_TC, sin_TC, k_cache, v_cache, meta)
        h_BD = self.norm(x_TD.index_select(0, logits_rows_B))
        # float32 rows, each contiguous: a CPU head computes them transposed (`logits`), and the sampler's
        # per-row reductions striding across the vocabulary took a verify step's 5 rows ~0.4 ms, not ~0.1
        return self.logits(h_BD).to(torch.float32, memory_format=torch.contiguous_format).contiguous()

    def forward_train(self, input_ids_BL: torch.Tensor, routes_BLMK: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, L, V] (float32) of right-padded sequences that start at position 0; differentiable.
        `routes_BLMK`: the experts the server routed each token to in each MoE layer, replayed (-1: none
        recorded, the router decides)."""
        return self.logits(self.hidden_train(input_ids_BL, routes_BLMK)).float()

    def hidden_train(self, input_ids_BL: torch.Tensor, routes_BLMK: torch.Tensor | None = None) -> torch.Tensor:
        """forward_train up to the final norm: [B, L, D] (the trainer runs the LM head on scored rows only)."""
        L = input_ids_BL.shape[1]
        x_BLD = self.embed_tokens(input_ids_BL)
        cos_LC, sin_LC = self.cos_sin(torch.arange(L, device=input_ids_BL.device), x_BLD.dtype)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # keep only the layer's input; its backward runs the layer again (replay counts not twice)
                from torch.utils.checkpoint import checkpoint

                x_BLD = checkpoint(
                    _forward_dense_in_dtype, layer, x_BLD, cos_LC, sin_LC, routes_BLMK, use_reentrant=False,
                    context_fn=lambda: (contextlib.nullcontext(), _recomputing()))
            else:
                x_BLD = layer.forward_dense(x_BLD, cos_LC, sin_LC, routes_BLMK)
        return self.norm(x_BLD)

    def to_training(self, mxfp8_experts: bool) -> Qwen3MoeModel:
        """Make the expert weights trainable Parameters (masters in the model's dtype); with
        `mxfp8_experts` their forward uses the MXFP8 round trip, as served. Returns self."""
        for moe in self.moe_layers():
            for name in ("w13", "w2"):
                w = getattr(moe, name)
                master = w.dequantize(self.embed_tokens.weight.dtype) if isinstance(w, MXFP8Tensor) else w
                setattr(moe, name, nn.Parameter(master.detach().clone()))
            moe.train_mxfp8 = mxfp8_experts
            moe.quant_cache = QuantCache() if mxfp8_experts else None
        self.train()
        return self

    def pack_for_cpu(self, min_linear_elements: int = cpu_pack.MIN_PACKED_ELEMENTS,
                     cpu_kernels: ModuleType | None = None) -> str:
        """Inference on a CPU (the model cannot train after it): each layer's q/k/v projections fused into
        one, the weights of large linear layers reordered for oneDNN (kernels/cpu_pack.py), and plain expert
        weights stored for the expert path that will read them. No extra memory: each new layout replaces
        the old one.

        Experts: with `cpu_kernels` (kernels/cpu_ext.py's module, if built) they are blocked for its expert
        kernel (kernels/moe.py's block_experts), which runs them all in one call. Without, the torch grouped
        path runs `x @ w[e].T` with a few rows per expert, and MKL streams a [D, N] matrix stored row-major
        1.1-1.4x faster than the transpose of an [N, D] one at those sizes (batch 8: 4.8 -> 3.7 ms per e32
        layer): they are stored input-major, keeping their [E, N, D] shape (a transposed view). A
        oneDNN-packed copy per expert was measured too: faster from ~8 rows, slower at 1-2 (decode at low
        concurrency), so not used. Returns what was done ("" for nothing: off a CPU; "q/k/v fused" alone where oneDNN lacks the dtype)."""
        dtype = self.embed_tokens.weight.dtype
        if self.embed_tokens.weight.device.type != "cpu":
            return ""  # nothing to say on the start-up line
        for layer in self.layers:
            layer.self_attn.fuse_qkv()
        if dtype == torch.float64:  # the built-in model as served: one q/k/v matmul still saves two ops per
            # layer, which its decode step is bound by; its experts' few-row steps take the float64 kernel
            for moe in self.moe_layers():  # moe_forward takes the float64 kernel for its few-row steps
                moe.cpu_kernels = cpu_kernels
            linear = cpu_kernels if hasattr(cpu_kernels, "linear_f64") else None

            def fit(*mods: nn.Module) -> ModuleType | None:  # the kernels, where every weight suits linear_f64
                return linear if linear is not None and all(numerics.linear_f64_takes(m) for m in mods) else None

            self.f64_kernels = fit(self.lm_head if self.lm_head is not None else self.embed_tokens)
            for layer in self.layers:
                layer.self_attn.f64_kernels = fit(layer.self_attn.qkv_proj, layer.self_attn.o_proj)
            for moe in self.moe_layers():
                moe.gate_kernels = fit(moe.gate)
            return "q/k/v fused" + (", experts' decode rows in the float64 CPU kernel"
                                    if hasattr(cpu_kernels, "moe_experts_f64") else "") \
                + (", projections' and LM head's in the float64 linear kernel" if linear is not None else "")
        if not cpu_pack.available(dtype):
            return "q/k/v fused"
        n = cpu_pack.pack_linears(self, min_linear_elements)
        experts = 0
        for moe in self.moe_layers():
            for name in ("w13", "w2"):
                w = getattr(moe, name)
                if isinstance(w, torch.Tensor) and w.dim() == 3 and w.is_contiguous():
                    setattr(moe, name, block_experts(w, cpu_kernels.moe_block_columns()) if cpu_kernels is not None
                            else w.transpose(1, 2).contiguous().transpose(1, 2))
                    experts += 1
            moe.cpu_kernels = cpu_kernels
        return (f"q/k/v fused, {n} linear layer{'s' * (n != 1)} packed for oneDNN"
                + ("" if not experts else ", experts blocked for the CPU kernel" if cpu_kernels is not None
                   else ", experts stored input-major"))

    def decode_plan(self, cpu_kernels: ModuleType | None) -> tuple[list, ...] | None:
        """The per-layer weights `cpu_kernels.decode_layers` takes (kernels/csrc/decode_layers_cpu.cpp: every
        layer of a decode step in one call, the same ops as `DecoderLayer.forward`), gathered once; None where
        decode steps do not take that call: `fused_decode` off, no kernels, or a layer it does not cover
        (it covers q/k/v fused without biases, MoE with the CPU expert kernel on blocked weights, as
        pack_for_cpu with cpu_kernels leaves them, one norm epsilon)."""
        if not self.fused_decode or cpu_kernels is None:
            return None
        if getattr(self, "_decode_plan_for", None) is not cpu_kernels:
            self._decode_plan, self._decode_plan_for = self._gather_decode_plan(cpu_kernels), cpu_kernels
        return self._decode_plan

    def _gather_decode_plan(self, cpu_kernels: ModuleType) -> tuple[list, ...] | None:
        def weight(m: nn.Module) -> tuple[torch.Tensor, int] | None:
            if isinstance(m, cpu_pack.PackedLinear) and m.bias is None:
                return m.packed, 1
            if type(m) is nn.Linear and m.bias is None:
                return m.weight, 0
            return None

        if not hasattr(cpu_kernels, "decode_layers"):
            return None
        dtype = self.embed_tokens.weight.dtype
        lists: tuple[list, ...] = tuple([] for _ in range(10))
        ln1, ln2, qkv, o, gate, packed, q_norm, k_norm, w13b, w2b = lists
        for layer in self.layers:
            attn, moe = layer.self_attn, layer.mlp
            if attn.qkv_proj is None or not isinstance(moe, SparseMoE) or moe.cpu_kernels is not cpu_kernels:
                return None
            ws = [weight(attn.qkv_proj), weight(attn.o_proj), weight(moe.gate)]
            experts = (moe.w13, moe.w2)
            if (None in ws or moe.train_mxfp8 or not all(blocked(w) and w.dtype == dtype for w in experts)
                    or len({n.eps for n in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm,
                                            attn.k_norm)} | {self.cfg.rms_norm_eps}) != 1):
                return None
            ln1.append(layer.input_layernorm.weight.detach())
            ln2.append(layer.post_attention_layernorm.weight.detach())
            for dest, (w, is_packed) in zip((qkv, o, gate), ws, strict=True):
                dest.append(w.detach())
                packed.append(is_packed)
            q_norm.append(attn.q_norm.weight.detach().float())
            k_norm.append(attn.k_norm.weight.detach().float())
            w13b.append(moe.w13)
            w2b.append(moe.w2)
        return lists

    def weight_bytes(self) -> tuple[int, int]:
        """(dense bytes, expert bytes) as stored."""
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        dense += sum(m.stored_bytes for m in self.modules() if isinstance(m, cpu_pack.PackedLinear))
        experts = 0
        for moe in self.moe_layers():
            for w in (moe.w13, moe.w2):
                experts += w.nbytes() if isinstance(w, MXFP8Tensor) else w.numel() * w.element_size()
        return dense, experts
