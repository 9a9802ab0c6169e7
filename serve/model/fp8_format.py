"""Qwen's own FP8 checkpoints (Qwen3-30B-A3B-Instruct-2507-FP8, Qwen3-Coder-30B-A3B-Instruct-FP8, ...): the format.

config.json says `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", ...norms, mlp.gate...]}`
(transformers' FineGrainedFP8Config, DeepSeek-V3's layout). Every converted nn.Linear is stored as
`<module>.weight` float8_e4m3fn [N, K] plus `<module>.weight_scale_inv` float32 [ceil(N/128), ceil(K/128)]
(kernels/fp8_block.py has the arithmetic); experts per expert (`mlp.experts.{e}.{gate,up,down}_proj`);
the LM head, embeddings, norms and the router stay bf16.

What the native loader accepts: that layout with e4m3 weights and float scales, any positive block size;
"dynamic" activations (the native engine keeps activations in bf16, W8A16, so there is nothing to read;
a "static" scheme's per-tensor activation scales would be ignored, so it is refused). Every FP8 weight must
have its scale with exactly the grid above: `check_tensors` names the first that does not, before a byte
is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kernels.fp8_block import check_pair, scale_shape
from serve.model.config import UnsupportedModel

SCALE_SUFFIX = "_scale_inv"
# what Qwen's FP8 releases leave unconverted (transformers reads the same list)
NOT_CONVERTED = ("lm_head", "embed_tokens", "layernorm", "norm", "mlp.gate")


def is_block_fp8(qc: dict[str, Any] | None) -> bool:
    return bool(qc) and qc.get("quant_method") == "fp8"


def block_of(qc: dict[str, Any], where: str = "checkpoint") -> tuple[int, int]:
    """The (rows, cols) scale block of a block-FP8 quantization_config; UnsupportedModel for what we do not read."""
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModel(f"{where}: fp8 quantization_config without a 2-D weight_block_size ({block!r}): the "
                               "native engine reads block-FP8 checkpoints only (per-tensor FP8 is not supported)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModel(f"{where}: fp8 activation_scheme {qc.get('activation_scheme')!r}: the native engine "
                               "reads 'dynamic' only (it keeps activations in bf16 and would ignore static scales)")
    if qc.get("fmt", "e4m3") != "e4m3" or qc.get("scale_fmt", "float") != "float":
        raise UnsupportedModel(f"{where}: fp8 fmt {qc.get('fmt')!r} / scale_fmt {qc.get('scale_fmt')!r}: the "
                               "native engine reads e4m3 weights with float scales")
    return int(block[0]), int(block[1])


def quantization_config(block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    """config.json's quantization_config as Qwen's FP8 releases write it."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}


def check_tensors(shapes: dict[str, tuple[str, list[int]]], block: tuple[int, int], where: str) -> None:
    """`shapes`: every tensor's name -> (safetensors dtype, shape). Raise ValueError naming the first FP8
    weight whose scale is missing or misshapen (or a scale without its weight)."""
    for name, (dtype, shape) in sorted(shapes.items()):
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX)
            if weight not in shapes or not shapes[weight][0].startswith("F8"):
                raise ValueError(f"{where}: {name} has no FP8 weight {weight} beside it")
            continue
        if not dtype.startswith("F8"):
            continue
        if dtype != "F8_E4M3" or not name.endswith(".weight") or len(shape) != 2:
            raise ValueError(f"{where}: {name} is {dtype} {shape}; block FP8 weights are 2-D F8_E4M3 `.weight`s")
        scale = name + SCALE_SUFFIX
        if scale not in shapes:
            raise ValueError(f"{where}: {name} is FP8 but its scale tensor {scale} is missing; refusing to serve it")
        s_dtype, s_shape = shapes[scale]
        want = list(scale_shape(tuple(shape), block))
        if s_shape != want or s_dtype not in ("F32", "BF16", "F16"):
            raise ValueError(f"{where}: {scale} is {s_dtype} {s_shape}; weight {name} {shape} in "
                             f"{block[0]}x{block[1]} blocks needs a float32 {want}")


def quantizable(name: str, t: torch.Tensor) -> bool:
    """Whether Qwen's FP8 releases convert this tensor: 2-D Linear weights outside NOT_CONVERTED."""
    return t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in NOT_CONVERTED)


def write_checkpoint(src: str | Path, dst: str | Path, quantize, block: tuple[int, int] = (128, 128)) -> int:
    """Copy a bf16 Qwen3-MoE checkpoint (one model.safetensors) to `dst` in Qwen's FP8 layout: `quantize(w)` ->
    (e4m3 data, float32 scale_inv) for every tensor `quantizable` says, the rest as is; config.json gains
    quantization_config; tokenizer files are copied. For tests and benchmarks (no FP8 checkpoint can be
    downloaded here). Returns how many tensors were quantized."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.safetensors"):
            shutil.copy(f, dst / f.name)
    out, n = {}, 0
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if quantizable(name, t):
                data, scale_inv = quantize(t)
                check_pair(data, scale_inv, block, name)
                out[name], out[name + SCALE_SUFFIX], n = data.contiguous(), scale_inv.float().contiguous(), n + 1
            else:
                out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(block)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return n
