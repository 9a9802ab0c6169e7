"""Loading Qwen3-MoE checkpoints (sharded safetensors) into the native model, one tensor at a time.

The model is built on the meta device and given uninitialised storage, then each checkpoint tensor is
read (memory-mapped by safetensors) and copied into place, so the full model never exists twice.
Experts arrive per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the layout of real
checkpoints) or fused (`mlp.experts.gate_up_proj`, transformers 5); they are stacked into w13
[E, 2I, D] and w2 [E, D, I]. With quant="mxfp8" each layer's experts are quantized as soon as the
layer is complete, so only one layer's high-precision experts exist at a time. Checkpoints that
already store MXFP8 experts load as is: the compressed-tensors layout (per-expert fp8 `.weight` plus
uint8 E8M0 `.weight_scale`, serve/model/ct_format.py; what train/ writes) and the fused layout train/
wrote before it (fp8 `gate_up_proj` plus `gate_up_proj_scale`). Qwen's own block-FP8 checkpoints
(quant_method "fp8", e4m3 weights + float32 `weight_scale_inv` per 128x128 block; serve/model/fp8_format.py)
load too: every FP8 weight's scale is checked before a byte is read (a missing or misshapen one is refused
by name); experts are dequantized and, with quant="mxfp8", re-encoded to MXFP8 per layer (the relative error
of that re-encoding is logged and kept in `model.fp8_report`); dense layers become FP8Linear modules
(serve/model/fp8.py) with `keep_fp8` (the engine on a GPU), else are dequantized to the model's dtype.
A checkpoint quantized any other way is refused by name rather than read as numbers it is not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from kernels import MXFP8Tensor
from kernels.fp8_block import dequantize_block_fp8, mxfp8_reencode_error
from serve.model import ct_format, fp8_format
from serve.model.config import ModelConfig, UnsupportedModel
from serve.model.qwen3_moe import Qwen3MoeModel, SparseMoE

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale)?$")
log = logging.getLogger(__name__)
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
               quant: str = "none", keep_fp8: bool = False) -> Qwen3MoeModel:
    """`keep_fp8`: a block-FP8 checkpoint's dense layers stay FP8 (FP8Linear; for the engine on a GPU), else
    they are dequantized to `dtype` (the CPU, the trainer)."""
    from safetensors import safe_open

    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    qc = cfg.quantization_config
    block = fp8_format.block_of(qc, str(path)) if fp8_format.is_block_fp8(qc) else None
    if block is None and not ct_format.is_ours(qc):
        raise UnsupportedModel(f"{path} is quantized as {ct_format.describe(qc)}; the native engine reads "
                               "unquantized checkpoints, MXFP8 experts (compressed-tensors mxfp8-quantized) and "
                               "block FP8 (quant_method fp8, as Qwen's FP8 releases); use --engine vllm")
    with contextlib.ExitStack() as stack:
        handles = {shard: stack.enter_context(safe_open(str(shard), framework="pt", device="cpu"))
                   for shard in shard_files(path)}
        scales: dict[str, object] = {}
        if block is not None:  # every FP8 weight's scale, checked before anything is read
            shapes = {n: (f.get_slice(n).get_dtype(), list(f.get_slice(n).get_shape()))
                      for f in handles.values() for n in f.keys()}
            fp8_format.check_tensors(shapes, block, str(path))
            scales = {n: f for f in handles.values() for n in f.keys() if n.endswith(fp8_format.SCALE_SUFFIX)}
        return _load(path, cfg, handles, scales, block, device, dtype, quant, keep_fp8)


def _load(path: Path, cfg: ModelConfig, handles: dict, scales: dict, block: tuple[int, int] | None,
          device, dtype: torch.dtype, quant: str, keep_fp8: bool) -> Qwen3MoeModel:
    from serve.model.fp8 import FP8Linear, fuse_qkv

    model = empty_model(cfg, device, dtype)
    reencode: list[float] = []  # per MoE layer: relative error of block FP8 -> MXFP8

    def block_fp8(name: str, t: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        scale = scales[name + fp8_format.SCALE_SUFFIX].get_tensor(name + fp8_format.SCALE_SUFFIX)
        return dequantize_block_fp8(t.to(device), scale.to(device), out_dtype, block)

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
            if block is not None:  # block FP8 -> MXFP8 is lossy: measure it on this layer's values
                reencode.append(max(mxfp8_reencode_error(w13), mxfp8_reencode_error(w2)))
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

    for f in handles.values():
        for name in f.keys():
            if block is not None and name.endswith(fp8_format.SCALE_SUFFIX):
                continue  # read with its weight
            if m := _EXPERT.match(name):
                i, e, which, is_scale = int(m.group(1)), int(m.group(2)), m.group(3), bool(m.group(4))
                t = f.get_tensor(name)
                if block is not None and t.dtype == torch.float8_e4m3fn:
                    t = block_fp8(name, t, dtype)  # experts: dequantized, then stacked like plain ones
                elif is_scale or t.dtype == torch.float8_e4m3fn:  # compressed-tensors MXFP8
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
                if block is not None and f.get_slice(name).get_dtype().startswith("F8"):
                    parent_name, _, leaf = key.rpartition(".")[0].rpartition(".")
                    parent = model.get_submodule(parent_name)
                    linear = getattr(parent, leaf)
                    if keep_fp8 and type(linear) is nn.Linear:
                        scale = scales[name + fp8_format.SCALE_SUFFIX].get_tensor(name + fp8_format.SCALE_SUFFIX)
                        setattr(parent, leaf, FP8Linear(f.get_tensor(name).to(device), scale.to(device),
                                                        linear.bias, block))
                    else:
                        params[key].data.copy_(block_fp8(name, f.get_tensor(name), dtype))
                    loaded.add(key)
                    continue
                if f.get_slice(name).get_dtype().startswith("F8"):
                    raise UnsupportedModel(f"{path}: {name} is stored in fp8; the native engine reads fp8 "
                                           "only for MXFP8 experts")
                params[key].data.copy_(f.get_tensor(name))
                loaded.add(key)
    missing = [k for k in params if k not in loaded]
    if missing or pending or expert_mx or any(moe.w13.numel() == 0 if isinstance(moe.w13, torch.Tensor) else False
                                 for moe in moes.values()):
        raise ValueError(f"{path}: checkpoint is incomplete: missing {missing[:5] or sorted(pending | expert_mx)[:5]}")
    if block is not None:
        for layer in model.layers:  # before anything fuses q/k/v as plain weights (that would drop the scales)
            if isinstance(getattr(layer.self_attn, "q_proj", None), FP8Linear):
                fuse_qkv(layer.self_attn)
        kept = sum(isinstance(m, FP8Linear) for m in model.modules())
        model.fp8_report = {"block": list(block), "dense_fp8_layers": kept,
                            "experts": "mxfp8 (re-encoded)" if reencode else f"dequantized to {str(dtype).removeprefix('torch.')}",
                            "mxfp8_reencode_rel_rms_max": max(reencode, default=None)}
        log.info("%s: block FP8 checkpoint (%dx%d): %s, experts %s%s", path, *block,
                 f"{kept} dense layers kept in FP8" if kept else f"dense layers dequantized to {str(dtype).removeprefix('torch.')}",
                 model.fp8_report["experts"],
                 f", re-encoding error (relative RMS, worst layer) {max(reencode):.4f}" if reencode else "")
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
