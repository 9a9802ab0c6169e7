"""Building blocks of Qwen3-MoE: RMSNorm, rotary embeddings (default, linear, YaRN), paged attention.

Attention reads keys and values from a paged cache (flat slots: block * block_size + offset). Decode
sequences (one new token each) go through kernels/cpu_attention.py on a CPU where it is built (it reads
the pages in place); otherwise they are gathered into one padded batch and run through a single SDPA
call with a length mask. Prefill chunks run per sequence with a causal mask offset by the tokens already
cached. SDPA is torch's, so the same code runs on CPU and GPU. This is the eager path; a GPU's
decode-only steps go through serve/model/decode.py, whose attention reads the pages in place
(kernels/paged_attention.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused import apply_rope as apply_rope  # the model's rotary: kernels keep its one definition
from kernels.fused import rms_norm
from kernels.moe_reference import acc_dtype
from serve.model import numerics
from serve.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.exact: bool | str = False  # batch-invariant numerics' mode (serve/model/numerics.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return numerics.rms_norm(x, self.weight, self.eps, self.exact) if self.exact else rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [C/2], attention scaling) for the config's rope type."""
    r = cfg.rope
    base, dim = float(r["rope_theta"]), cfg.head_dim
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    kind = r["rope_type"]
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    factor = float(r.get("factor") or 1.0)
    if kind == "linear":
        return 1.0 / pos_freqs / factor, 1.0
    # YaRN (arXiv:2309.00071): interpolate low frequencies, extrapolate high ones, ramp in between.
    original = r.get("original_max_position_embeddings") or cfg.max_position_embeddings
    attention = r.get("attention_factor")
    if attention is None:
        m, m_all = r.get("mscale"), r.get("mscale_all_dim")
        attention = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    beta_fast, beta_slow = r.get("beta_fast") or 32, r.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if r.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class Rotary:
    def __init__(self, cfg: ModelConfig, device: torch.device):
        inv, self.scaling = rope_inv_freq(cfg)
        self.inv_freq = inv.to(device)

    def cos_sin(self, positions_T: torch.Tensor, dtype: torch.dtype,
                acc: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, C] in `dtype`, computed in `acc` (default acc_dtype): a position's values must not
        depend on where in the tensor it sits (vectorised and scalar cos differ in the last float32 bit),
        so the batch-invariant mode passes float64."""
        acc = acc or acc_dtype(dtype)
        freqs_TC2 = positions_T.to(acc)[:, None] * self.inv_freq.to(acc)[None, :]
        emb_TC = torch.cat([freqs_TC2, freqs_TC2], dim=-1)
        return (emb_TC.cos() * self.scaling).to(dtype), (emb_TC.sin() * self.scaling).to(dtype)


@dataclass
class SeqSlice:
    """One sequence's share of a step: its new tokens are x[start : start + q_len]."""

    start: int
    q_len: int
    ctx_len: int  # tokens in the cache after this step's tokens are written (cached + new)
    slots_L: torch.Tensor  # cache slots of all ctx_len tokens, in order


@dataclass
class AttnMeta:
    slot_mapping_T: torch.Tensor  # where each new token's K/V goes
    prefill: list[SeqSlice]
    decode_rows_B: torch.Tensor  # positions in x of the decode tokens
    decode_slots_BL: torch.Tensor | None = None  # padded cache slots of each decode sequence (torch path)
    decode_mask_B1L: torch.Tensor | None = None  # True where a decode query may attend (torch path)
    cpu_kernels: ModuleType | None = None  # kernels/cpu_ext.py's module: decode reads pages in place, etc.
    few_query_kernel: Callable | None = None
    """kernels/cpu_ext.py's few_query_attention (float64, pages read in place), where built: a float64
    model's few-query attention then runs it instead of gathering the pages (`few_rows`)."""
    decode_tables_BN: torch.Tensor | None = None  # padded block tables of the decode sequences (kernel)
    decode_lens_B: torch.Tensor | None = None  # tokens each decode sequence attends to (kernel)
    block_size: int = 0
    routes_SMK: torch.Tensor | None = None  # per cache slot, the experts each MoE layer sent its token to
    """Written by every MoE layer at slot_mapping_T (routing replay: serve/routed_experts.py)."""


def paged_attention(q_THC: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                    num_kv_heads: int, exact: bool | str = False) -> torch.Tensor:
    """q [T, H, C] against the cache ([slots, G, C] each); returns [T, H, C]. `exact`: batch-invariant
    numerics' mode (serve/model/numerics.py; the gathered decode path, not the C++ kernel)."""
    T = q_THC.shape[0]
    # Gathers use index_select, not advanced indexing: on a CPU `cache[slots_BL]` is ~9x slower for the
    # same rows (a decode step at batch 8 spent ~12% of its time there).
    if meta.decode_rows_B.numel():
        B = meta.decode_rows_B.shape[0]
        only_decode = not meta.prefill and B == T  # every row decodes, in order: no gather or scatter of q
        q_BHC = q_THC if only_decode else q_THC.index_select(0, meta.decode_rows_B)
        if B == 1 and few_queries(q_BHC, 1, exact) and meta.cpu_kernels is None:  # one sequence: no padding, no mask
            o_BHC = few_rows(q_BHC, k_cache, v_cache, meta.decode_slots_BL[0], meta)
        elif meta.cpu_kernels is not None and not exact:  # CPU: read each sequence's pages in place
            o_BHC = meta.cpu_kernels.paged_decode_attention(q_BHC, k_cache, v_cache, meta.decode_tables_BN,
                                                              meta.decode_lens_B, meta.block_size,
                                                              q_BHC.shape[-1] ** -0.5)
        else:
            L = meta.decode_slots_BL.shape[1]
            flat = meta.decode_slots_BL.reshape(-1)
            k_BGLC = k_cache.index_select(0, flat).view(B, L, num_kv_heads, -1).permute(0, 2, 1, 3)
            v_BGLC = v_cache.index_select(0, flat).view(B, L, num_kv_heads, -1).permute(0, 2, 1, 3)
            if exact:
                o_BHC = numerics.attention(q_BHC.unsqueeze(2), k_BGLC, v_BGLC, meta.decode_mask_B1L, exact).squeeze(2)
            else:
                # One query a row: SDPA's math path with grouped heads reads K/V as they are. The flash kernel
                # would need them repeated per head first: 2.6x (bf16) to 25x (float64) slower at Qwen3-30B's
                # heads, 8 rows of 2,048 keys (measured on the 2-core VM).
                o_BHC = F.scaled_dot_product_attention(q_BHC.unsqueeze(2), k_BGLC, v_BGLC,
                                                       attn_mask=meta.decode_mask_B1L[:, None],
                                                       enable_gqa=q_BHC.shape[1] != num_kv_heads).squeeze(2)
        if only_decode:
            return o_BHC
    out_THC = torch.empty_like(q_THC)
    if meta.decode_rows_B.numel():
        out_THC.index_copy_(0, meta.decode_rows_B, o_BHC)
    for s in meta.prefill:
        if s.ctx_len > s.q_len and few_queries(q_THC, s.q_len, exact):  # e.g. verifying a draft after a cache
            out_THC[s.start : s.start + s.q_len] = few_rows(q_THC[s.start : s.start + s.q_len], k_cache, v_cache,
                                                            s.slots_L, meta)
            continue
        q_HQC = q_THC[s.start : s.start + s.q_len].transpose(0, 1)
        k_GLC = k_cache.index_select(0, s.slots_L).transpose(0, 1)
        v_GLC = v_cache.index_select(0, s.slots_L).transpose(0, 1)
        if exact:
            o = numerics.attention(q_HQC[None], k_GLC[None], v_GLC[None],
                                   numerics.causal(s.q_len, s.ctx_len, q_THC.device), exact)[0]
        else:
            cached = s.ctx_len - s.q_len  # new tokens after a cached prefix (or an earlier chunk): causal, offset
            o = attention(q_HQC[None], k_GLC[None], v_GLC[None],
                          numerics.causal(s.q_len, s.ctx_len, q_THC.device)[0] if cached else None)[0]
        out_THC[s.start : s.start + s.q_len] = o.transpose(0, 1)
    return out_THC


def attention(q_BHQC: torch.Tensor, k_BGLC: torch.Tensor, v_BGLC: torch.Tensor,
              mask_BQL: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of queries [B, H, Q, C] over keys [B, G, L, C]: causal (None) or where the bool mask allows
    ([Q, L] or [B, 1, Q, L]: the CPU flash kernel takes no other shape). The server's prefill chunks and
    the trainer's whole sequences both call this, so they take the same kernel (and sum in float32; SDPA's
    math path would round the scores to the model's dtype)."""
    if q_BHQC.device.type == "cpu":
        # torch's CPU flash kernel takes [B, H, L, C], a mask, and no enable_gqa (else SDPA falls back to
        # its math path, which materialises [H, Q, L] scores in the model's dtype: a 283-token turn after
        # 1,968 cached tokens spent ~15 of its ~19 ms per layer there; flash takes under half, and sums in
        # float32): kv heads repeated for it
        rep = q_BHQC.shape[1] // k_BGLC.shape[1]
        if rep > 1:
            k_BGLC, v_BGLC = k_BGLC.repeat_interleave(rep, 1), v_BGLC.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q_BHQC, k_BGLC, v_BGLC, attn_mask=mask_BQL, is_causal=mask_BQL is None)
    return F.scaled_dot_product_attention(q_BHQC, k_BGLC, v_BGLC, attn_mask=mask_BQL, is_causal=mask_BQL is None,
                                          enable_gqa=q_BHQC.shape[1] != k_BGLC.shape[1])


# A few query rows of one sequence (a decode, or verifying a short draft) on a CPU: the flash kernel's fixed
# cost per call dominates there (float64, 8 heads of 16 over ~500 cached keys: ~130 us for 1 query), where two
# batched matmuls on the gathered keys as they lie, with the heads grouped (no copies), and one softmax take
# ~70 us (one thread). Only for float32/float64 (the matmuls keep the scores in the dtype flash sums them in;
# bfloat16 scores would round), and not in the batch-invariant mode, which has its own kernels.
FEW_QUERIES = 16


def few_queries(q: torch.Tensor, q_len: int, exact: bool | str) -> bool:
    return (not exact and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and q_len <= FEW_QUERIES)


def few_rows(q_QHC: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots_L: torch.Tensor,
             meta: AttnMeta) -> torch.Tensor:
    """One sequence's last Q query rows over the keys at `slots_L` (its whole context, the Q new tokens
    last): the float64 C++ kernel where the runner has it (reads the pages in place: 2-3x faster than the
    gather and matmuls below at the built-in model's shape, BENCHMARKS.md), else `few_query_attention` on
    the gathered keys and values."""
    if (meta.few_query_kernel is not None and q_QHC.dtype == torch.float64 and q_QHC.shape[-1] % 8 == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return meta.few_query_kernel(q_QHC, k_cache, v_cache, slots_L, q_QHC.shape[-1] ** -0.5)
    return few_query_attention(q_QHC, k_cache.index_select(0, slots_L), v_cache.index_select(0, slots_L),
                               slots_L.shape[0] - q_QHC.shape[0])


def few_query_attention(q_QHC: torch.Tensor, k_LGC: torch.Tensor, v_LGC: torch.Tensor, cached: int = 0) -> torch.Tensor:
    """Attention of one sequence's last Q positions ([Q, H, C]) over its L keys and values ([L, G, C], as
    gathered from the cache), query i seeing keys up to cached + i; SDPA's default scale, head h reading kv
    head h // (H / G) (enable_gqa's grouping). Returns [Q, H, C]."""
    Q, H, C = q_QHC.shape
    L, G = k_LGC.shape[0], k_LGC.shape[1]
    rep = H // G
    q_GMC = q_QHC.reshape(Q, G, rep, C).permute(1, 2, 0, 3).reshape(G, rep * Q, C)  # rows (r, i) of kv head g
    s_GML = torch.bmm(q_GMC, k_LGC.permute(1, 2, 0)).mul_(C ** -0.5)
    if Q > 1:  # query i must not see the draft tokens after it
        later_QL = torch.ones(Q, Q, dtype=torch.bool, device=q_QHC.device).triu_(1)
        s_GML.view(G, rep, Q, L)[..., cached:].masked_fill_(later_QL, float("-inf"))
    o_GMC = torch.bmm(torch.softmax(s_GML, dim=-1), v_LGC.permute(1, 0, 2))
    return o_GMC.view(G, rep, Q, C).permute(2, 0, 1, 3).reshape(Q, H, C)
