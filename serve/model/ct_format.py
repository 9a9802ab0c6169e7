"""MXFP8 experts in the compressed-tensors layout: what composer-train writes and vLLM reads.

compressed-tensors (the format vLLM and llm-compressor use) stores an MXFP8 weight per nn.Linear:
`<module>.weight` float8_e4m3fn [N, K] and `<module>.weight_scale` uint8 [N, K / 32], each scale a
biased E8M0 exponent (value = 2 ** (s - 127)) over 32 consecutive inputs, and says so in config.json's
`quantization_config` (quant_method "compressed-tensors", format "mxfp8-quantized", the MXFP8A16
scheme: 8-bit float weights, group 32, uint8 scales, activations not quantized). For Qwen3-MoE experts
the modules are `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`, the per-expert names of real
checkpoints, which vLLM's compressed-tensors MoE method (CompressedTensorsW8A8Mxfp8MoEMethod) stacks
into its fused w13/w2 with the scales beside them.

The codes and scales written are exactly the ones composer-serve computes with (the trainer's own
quantizer), not a re-quantization. tests/train/test_ct_checkpoint.py checks the config and the
tensors against the compressed-tensors package itself (its MXFP8A16 preset and its MXFP8 compressor's
decompression), so this module needs no dependency at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kernels import MXFP8Tensor

EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
FORMAT = "mxfp8-quantized"
EXPORT_HINT = ("transformers cannot decompress MXFP8 experts (its compressed-tensors loader ignores group scales "
               "for MoE experts); write a plain copy with `composer-train export DIR --out OUT --dtype bf16` "
               "and load OUT instead")


def quantization_config() -> dict[str, Any]:
    """config.json's `quantization_config` for MXFP8A16 experts (everything else unquantized)."""
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": [EXPERT_TARGET],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
                        "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"},
            "input_activations": None, "output_activations": None, "format": FORMAT}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def is_ours(qc: dict[str, Any] | None) -> bool:
    """Whether a checkpoint's quantization_config is one the native loader reads: none, or MXFP8 experts
    in compressed-tensors (any target spelling, as long as every group is MXFP8 weights only)."""
    if not qc:
        return True
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != FORMAT:
        return False
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size"), w.get("strategy")) != (8, "float", 32, "group"):
            return False
        if str(w.get("scale_dtype", "")).removeprefix("torch.") != "uint8" or group.get("input_activations"):
            return False
    return True


def describe(qc: dict[str, Any]) -> str:
    weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
    schemes = sorted({f"{w.get('type')}{w.get('num_bits')}/{w.get('strategy')}" for w in weights})
    return f"{qc.get('quant_method')} {qc.get('format') or ''} {', '.join(schemes)}".strip()


def refuse_for_transformers(model_dir: str | Path) -> None:
    """Raise a clear ValueError before transformers is asked to load MXFP8 experts it would fail on."""
    try:
        qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return  # transformers reports a missing or broken config itself
    if qc and qc.get("format") == FORMAT:
        raise ValueError(f"{model_dir} stores MXFP8 experts (compressed-tensors {FORMAT}): {EXPORT_HINT}; "
                         "or serve it with --engine native")


def expert_tensors(i: int, w13: MXFP8Tensor, w2: MXFP8Tensor) -> dict[str, torch.Tensor]:
    """One MoE layer's experts as per-expert compressed-tensors entries (w13 rows are [gate; up])."""
    out = {}
    inter = w13.data.shape[1] // 2
    s13, s2 = w13.scales.view(torch.uint8), w2.scales.view(torch.uint8)
    for e in range(w13.data.shape[0]):
        pre = f"model.layers.{i}.mlp.experts.{e}."
        for name, data, scales in (("gate_proj", w13.data[e, :inter], s13[e, :inter]),
                                   ("up_proj", w13.data[e, inter:], s13[e, inter:]),
                                   ("down_proj", w2.data[e], s2[e])):
            out[pre + name + ".weight"] = data.contiguous()
            out[pre + name + ".weight_scale"] = scales.contiguous()
    return out
