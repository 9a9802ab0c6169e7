"""Checkpoints: a serving folder composer-serve loads as it is, plus what resuming needs.

    DIR/config.json, tokenizer files, chat_template.jinja, generation_config.json   (copied from the base)
    DIR/model.safetensors        dense weights + experts: MXFP8 in the compressed-tensors layout (per-expert
                                 fp8 `.weight` + uint8 E8M0 `.weight_scale`, serve/model/ct_format.py; vLLM
                                 reads it, config.json's `quantization_config` says so) when trained so, else
                                 plain per-expert tensors
    DIR/README.md                how to load it elsewhere (transformers needs `composer-train export`)
    DIR/composer_policy.json     policy_version, step, chat template hash, expert format
    DIR/training/masters.safetensors, optimizer.pt, state.json     (resume only: fp32 masters, AdamW
                                 moments, step, RNG states, the data loader's position)

`export_hf` writes the same weights (experts dequantized from what is served) as a plain bf16 or
fp32 checkpoint in the per-expert layout of real Qwen3-MoE checkpoints, which transformers loads
(`composer-train export`).
Every folder is written under a temporary name and renamed into place, so a crash mid-save leaves the
previous checkpoint whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kernels import MXFP8Tensor
from serve.engine.weights import POLICY_FILE
from serve.model import ct_format
from serve.model.loader import save_mxfp8_experts
from serve.model.qwen3_moe import Qwen3MoeModel, SparseMoE

COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
          "special_tokens_map.json")


def template_hash(model_dir: str | Path) -> str:
    """sha256 of what turns messages into ids: the chat template and the tokenizer."""
    h = hashlib.sha256()
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        p = Path(model_dir) / name
        if p.exists():
            h.update(name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def read_policy(model_dir: str | Path) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / POLICY_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _dense_state(model: Qwen3MoeModel) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if name.endswith((".w13", ".w2")):
            continue
        out[name if name == "lm_head.weight" else "model." + name] = p.detach().contiguous().clone()
    return out


def _per_expert(model: Qwen3MoeModel, dtype: torch.dtype, served: bool) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, SparseMoE):
            continue
        w13, w2 = layer.mlp.w13, layer.mlp.w2
        if isinstance(w13, MXFP8Tensor):  # loaded from an MXFP8 checkpoint: exactly what is served
            w13, w2 = w13.dequantize(torch.float32), w2.dequantize(torch.float32)
        elif served and layer.mlp.train_mxfp8:  # what the server computes with, not the masters
            w13, w2 = MXFP8Tensor.quantize(w13.detach()).dequantize(dtype), MXFP8Tensor.quantize(w2.detach()).dequantize(dtype)
        inter = w13.shape[1] // 2
        for e in range(w13.shape[0]):
            pre = f"model.layers.{i}.mlp.experts.{e}."
            out[pre + "gate_proj.weight"] = w13[e, :inter].detach().to(dtype).contiguous().clone()
            out[pre + "up_proj.weight"] = w13[e, inter:].detach().to(dtype).contiguous().clone()
            out[pre + "down_proj.weight"] = w2[e].detach().to(dtype).contiguous().clone()
    return out


def _write_dir(out_dir: Path, fill) -> Path:
    """Write a folder under a temporary name with `fill(tmp)`, then swap it into place."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        fill(tmp)
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _copy_base(base_dir: Path, dst: Path, dtype: torch.dtype, mxfp8_experts: bool) -> None:
    for name in COPIED:
        if (base_dir / name).exists():
            shutil.copy(base_dir / name, dst / name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("quantization_config", None)  # the base's says how ITS weights were stored, not these
    if mxfp8_experts:
        cfg["quantization_config"] = ct_format.quantization_config()
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    (dst / "README.md").write_text(model_card(dst.name, mxfp8_experts))


def model_card(name: str, mxfp8_experts: bool) -> str:
    """The checkpoint's README: what it is and what reads it."""
    if not mxfp8_experts:
        return (f"# {name}\n\nA Qwen3-MoE checkpoint written by composer-train: plain weights in the per-expert layout "
                "of Qwen3-MoE checkpoints. composer-serve, transformers and vLLM load it as it is.\n")
    return (f"# {name}\n\nA Qwen3-MoE checkpoint written by composer-train. Its experts are MXFP8 in the "
            "compressed-tensors `mxfp8-quantized` layout (fp8 `weight` + uint8 E8M0 `weight_scale` per expert "
            "projection, groups of 32), as `quantization_config` in config.json says.\n\n"
            "- composer-serve: `composer-serve --model DIR`\n"
            "- vLLM: `vllm serve DIR --dtype bfloat16` (compressed-tensors MXFP8 MoE)\n"
            f"- transformers: {ct_format.EXPORT_HINT}. Loading this folder directly fails in transformers' "
            "weight conversion (and without the compressed-tensors package, on the missing package).\n")


def save_policy(model: Qwen3MoeModel, base_dir: str | Path, out_dir: str | Path, *, policy_version: int,
                step: int, mxfp8_experts: bool, training: dict[str, Any] | None = None) -> Path:
    """The serving folder (and, with `training`, the resume state; see the module docstring)."""
    from safetensors.torch import save_file

    base_dir = Path(base_dir)
    dtype = model.embed_tokens.weight.dtype

    def fill(tmp: Path) -> None:
        _copy_base(base_dir, tmp, dtype, mxfp8_experts)
        tensors = _dense_state(model)
        tensors |= save_mxfp8_experts(model) if mxfp8_experts else _per_expert(model, dtype, served=False)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / POLICY_FILE).write_text(json.dumps({
            "policy_version": policy_version, "step": step, "experts": "mxfp8" if mxfp8_experts else str(dtype),
            "chat_template_hash": template_hash(tmp)}, indent=2))
        if training is not None:
            _save_training(model, tmp / "training", training)

    return _write_dir(Path(out_dir), fill)


def _save_training(model: Qwen3MoeModel, d: Path, training: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    d.mkdir()
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(d / "masters.safetensors"))
    torch.save({"optimizer": training["optimizer"].state_dict(), "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate()}, d / "optimizer.pt")
    (d / "state.json").write_text(json.dumps(training.get("state", {}), indent=2))


def load_training(ckpt_dir: str | Path, model: Qwen3MoeModel, optimizer) -> dict[str, Any]:
    """Restore fp32 masters, optimizer moments and RNG states in place; returns state.json."""
    from safetensors.torch import load_file

    d = Path(ckpt_dir) / "training"
    if not d.is_dir():
        raise FileNotFoundError(f"{ckpt_dir} has no training/ state to resume from (a serving-only checkpoint)")
    masters = load_file(str(d / "masters.safetensors"))
    params = dict(model.named_parameters())
    if set(masters) != set(params):
        raise ValueError(f"{ckpt_dir}: the saved masters do not match this model's parameters")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(masters[n])
    blob = torch.load(d / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    random.setstate(blob["python_rng"])
    return json.loads((d / "state.json").read_text())


def export_hf(model: Qwen3MoeModel, base_dir: str | Path, out_dir: str | Path,
              dtype: torch.dtype = torch.bfloat16) -> Path:
    """A plain checkpoint transformers loads: the served weights (MXFP8 experts dequantized) in `dtype`."""
    from safetensors.torch import save_file

    base_dir = Path(base_dir)

    def fill(tmp: Path) -> None:
        _copy_base(base_dir, tmp, dtype, mxfp8_experts=False)
        tensors = {k: v.to(dtype) for k, v in _dense_state(model).items()} | _per_expert(model, dtype, served=True)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return _write_dir(Path(out_dir), fill)
