"""Random weights made on the device from a checkpoint's config.json alone (vLLM's `--load-format dummy`).

`random_model` returns what `serve.model.loader.load_model` returns (a Qwen3MoeModel in eval mode, expert
weights as plain [E, 2I, D] / [E, D, I] tensors or MXFP8Tensor pairs), without reading any weight file:
for measuring speed and memory at a full model's shape (Qwen3-30B-A3B: ~60 GB in bf16) where writing and
reading a checkpoint would cost more than the measurement. The values are only meant to keep activations
finite and routing spread: norms 1, biases 0, other dense weights N(0, 0.02), experts N(0, 1/fan_in).

Every tensor is drawn on the device by a generator seeded from `seed` (the same seed on the same device
gives the same model). As in the loader, the model is built on the meta device and given storage once,
and experts are made one layer at a time (quantized at once with quant="mxfp8"), so at most one layer's
high-precision experts exist beside the model: nothing is allocated twice.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import MXFP8Tensor
from serve.model.config import ModelConfig
from serve.model.loader import empty_model
from serve.model.qwen3_moe import Qwen3MoeModel

DENSE_STD = 0.02


def random_model(model_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 quant: str = "none", seed: int = 0) -> Qwen3MoeModel:
    if quant not in ("none", "mxfp8"):
        raise ValueError(f"quant must be none or mxfp8, not {quant!r}")
    cfg = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    model = empty_model(cfg, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.ndim == 1:  # RMSNorm gains
                p.fill_(1.0)
            else:
                p.normal_(0.0, DENSE_STD, generator=gen)
        E, inter, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        for moe in model.moe_layers():
            # drawn in the model's dtype in place: a float32 draw then a cast would briefly hold 3x a
            # layer's bf16 experts (2.4 GB at the 30B shape)
            w13 = torch.empty(E, 2 * inter, D, dtype=dtype, device=device).normal_(0.0, D**-0.5, generator=gen)
            w2 = torch.empty(E, D, inter, dtype=dtype, device=device).normal_(0.0, inter**-0.5, generator=gen)
            if quant == "mxfp8":
                w13, w2 = MXFP8Tensor.quantize(w13), MXFP8Tensor.quantize(w2)
            moe.w13, moe.w2 = w13, w2
    model.eval()
    return model
