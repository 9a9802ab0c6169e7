"""A Qwen3-MoE checkpoint's config.json, read into one validated dataclass.

Accepts both spellings transformers has used: `num_experts` / `num_local_experts`, and `rope_theta` +
`rope_scaling` / `rope_parameters`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {"Qwen3MoeForCausalLM"}
# Qwen3-30B-A3B's config.json (the shape benchmarks and the memory plan's tests measure at; no weights)
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                     hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0,
                     tie_word_embeddings=False, attention_bias=False, torch_dtype="bfloat16")
SUPPORTED_ROPE = {"default", "linear", "yarn"}


class UnsupportedModel(ValueError):
    pass


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    torch_dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = None  # as config.json has it (serve/model/ct_format.py reads it)

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(f"{arch} checkpoints are not supported by the native engine "
                                   f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}); use --engine hf")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope.setdefault("rope_theta", raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
        if rope["rope_type"] not in SUPPORTED_ROPE:
            raise UnsupportedModel(f"rope_type {rope['rope_type']!r} is not supported by the native engine")
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw.get("intermediate_size", 0), moe_intermediate_size=raw["moe_intermediate_size"],
            num_experts=raw.get("num_experts", raw.get("num_local_experts", 0)),
            num_experts_per_tok=raw["num_experts_per_tok"], norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=raw.get("decoder_sparse_step", 1), mlp_only_layers=list(raw.get("mlp_only_layers", [])),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)), rope=rope,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            quantization_config=raw.get("quantization_config"),
        )
