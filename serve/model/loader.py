"""Loading Qwen3-MoE checkpoints (sharded safetensors) into the native model, one tensor at a time.

The model is built on the meta device and given uninitialised storage, then each checkpoint tensor is
read (memory-mapped by safetensors) and copied into place, so the full model never exists twice.
Experts arrive per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the layout of real
checkpoints) or fused (`mlp.experts.gate_up_proj`, transformers 5); they are stacked into w13
[E, 2I, D] and w2 [E, D, I]. With quant="mxfp8" each layer's experts are quantized as soon as the
layer is complete, so only one layer's high-precision experts exist at a time. Checkpoints that
already store MXFP8 experts load as is: the compressed-tensors layout (per-expert fp8 `.weight` plus
uint8 E8M0 `.weight_scale`, serve/model/ct_format.py; what train/ writes) and the fused layout train/
wrote before it (fp8 `gate_up_proj` plus `gate_up_proj_scale`). A checkpoint quantized any other way
is refused by name rather than read as numbers it is not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kernels import MXFP8Tensor
from serve.model import ct_format
from serve.model.config import ModelConfig, UnsupportedModel
from serve.model.qwen3_moe import Qwen3MoeModel, SparseMoE

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale)?$")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_scale)?$")


def shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors(.index.json) in {path}")


def empty_model(cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype) -> Qwen3MoeModel:
    """The model with uninitialised storage on `device`: built on the meta device, so nothing is allocated
    twice (the dtype is set there for free, then storage is given once). Expert weights come empty."""
    with torch.device("meta"):
        model = Qwen3MoeModel(cfg)
    return model.to(dtype).to_empty(device=device)


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               quant: str = "none") -> Qwen3MoeModel:
    from safetensors import safe_open

    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    qc = cfg.quantization_config
    if not ct_format.is_ours(qc):
        raise UnsupportedModel(f"{path} is quantized as {ct_format.describe(qc)}; the native engine reads "
                               "unquantized checkpoints and MXFP8 experts (compressed-tensors mxfp8-quantized); "
                               "use --engine vllm")
    model = empty_model(cfg, device, dtype)
    params = dict(model.named_parameters())
    moes = {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)}
    E, inter, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    pending: dict[int, dict[str, torch.Tensor | int]] = {}
    fused_mx: dict[int, dict[str, torch.Tensor]] = {}
    expert_mx: dict[int, dict[str, torch.Tensor | int]] = {}
    loaded: set[str] = set()

    def layer_buffers(i: int) -> dict:
        if i not in pending:
            pending[i] = {"w13": torch.empty(E, 2 * inter, D, dtype=dtype, device=device),
                          "w2": torch.empty(E, D, inter, dtype=dtype, device=device), "count": 0}
        return pending[i]

    def finish_layer(i: int, w13: torch.Tensor | MXFP8Tensor, w2: torch.Tensor | MXFP8Tensor) -> None:
        if quant == "mxfp8" and not isinstance(w13, MXFP8Tensor):
            w13, w2 = MXFP8Tensor.quantize(w13), MXFP8Tensor.quantize(w2)
        moes[i].w13, moes[i].w2 = w13, w2
        pending.pop(i, None)

    def expert_mx_buffers(i: int) -> dict:
        if i not in expert_mx:
            u8 = dict(dtype=torch.uint8, device=device)
            expert_mx[i] = {"w13": torch.empty(E, 2 * inter, D, dtype=torch.float8_e4m3fn, device=device),
                            "w2": torch.empty(E, D, inter, dtype=torch.float8_e4m3fn, device=device),
                            "w13_scale": torch.empty(E, 2 * inter, D // 32, **u8),
                            "w2_scale": torch.empty(E, D, inter // 32, **u8), "count": 0}
        return expert_mx[i]

    for shard in shard_files(path):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():
                if m := _EXPERT.match(name):
                    i, e, which, is_scale = int(m.group(1)), int(m.group(2)), m.group(3), bool(m.group(4))
                    t = f.get_tensor(name)
                    if is_scale or t.dtype == torch.float8_e4m3fn:  # compressed-tensors MXFP8
                        buf = expert_mx_buffers(i)
                        key = ("w2" if which == "down_proj" else "w13") + ("_scale" if is_scale else "")
                        rows = slice(None) if which == "down_proj" else slice(0, inter) if which == "gate_proj" \
                            else slice(inter, 2 * inter)
                        buf[key][e, rows].copy_(t.view(torch.uint8) if is_scale else t)
                        buf["count"] += 1
                        if buf["count"] == 6 * E:
                            finish_layer(i, MXFP8Tensor(buf["w13"], _e8m0(buf["w13_scale"])),
                                         MXFP8Tensor(buf["w2"], _e8m0(buf["w2_scale"])))
                            expert_mx.pop(i)
                        continue
                    buf = layer_buffers(i)
                    if which == "gate_proj":
                        buf["w13"][e, :inter].copy_(t)
                    elif which == "up_proj":
                        buf["w13"][e, inter:].copy_(t)
                    else:
                        buf["w2"][e].copy_(t)
                    buf["count"] += 1
                    if buf["count"] == 3 * E:
                        finish_layer(i, buf["w13"], buf["w2"])
                elif m := _FUSED.match(name):
                    i, which, is_scale = int(m.group(1)), m.group(2), bool(m.group(3))
                    t = f.get_tensor(name)
                    if t.dtype == torch.float8_e4m3fn or is_scale:
                        fused_mx.setdefault(i, {})[which + ("_scale" if is_scale else "")] = t.to(device)
                        got = fused_mx[i]
                        if len(got) == 4:
                            finish_layer(i, MXFP8Tensor(got["gate_up_proj"], _e8m0(got["gate_up_proj_scale"])),
                                         MXFP8Tensor(got["down_proj"], _e8m0(got["down_proj_scale"])))
                    else:
                        buf = layer_buffers(i)
                        buf["w13" if which == "gate_up_proj" else "w2"].copy_(t)
                        buf["count"] += 3 * E // 2 if which == "gate_up_proj" else 3 * E - 3 * E // 2
                        if buf["count"] == 3 * E:
                            finish_layer(i, buf["w13"], buf["w2"])
                else:
                    key = name.removeprefix("model.") if name.startswith("model.") and name != "lm_head.weight" else name
                    if key not in params:
                        continue  # e.g. rotary buffers some exporters save
                    if f.get_slice(name).get_dtype().startswith("F8"):
                        raise UnsupportedModel(f"{path}: {name} is stored in fp8; the native engine reads fp8 "
                                               "only for MXFP8 experts")
                    params[key].data.copy_(f.get_tensor(name))
                    loaded.add(key)
    missing = [k for k in params if k not in loaded]
    if missing or pending or expert_mx or any(moe.w13.numel() == 0 if isinstance(moe.w13, torch.Tensor) else False
                                 for moe in moes.values()):
        raise ValueError(f"{path}: checkpoint is incomplete: missing {missing[:5] or sorted(pending | expert_mx)[:5]}")
    model.eval()
    return model


def _e8m0(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.float8_e8m0fnu) if scales.dtype == torch.uint8 else scales


def save_mxfp8_experts(model: Qwen3MoeModel) -> dict[str, torch.Tensor]:
    """The expert tensors of `model` in MXFP8, compressed-tensors layout (for train/; config.json then
    needs `ct_format.quantization_config()`). Plain experts are quantized here as the server would."""
    out = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, SparseMoE):
            w13, w2 = (w if isinstance(w, MXFP8Tensor) else MXFP8Tensor.quantize(w.detach())
                       for w in (layer.mlp.w13, layer.mlp.w2))
            out |= ct_format.expert_tensors(i, w13, w2)
    return out
