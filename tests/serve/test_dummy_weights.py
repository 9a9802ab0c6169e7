"""`load_format="dummy"`: random weights from config.json alone (serve/model/dummy.py), shaped as the loader's."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from kernels import MXFP8Tensor
from serve.engine.base import SamplingParams
from serve.engine.native import EngineConfig, NativeEngine
from serve.model.dummy import random_model
from serve.model.loader import load_model


@pytest.fixture(scope="module")
def config_only(tiny_hermes, tmp_path_factory) -> Path:
    """The tiny checkpoint's config.json and nothing else: no weights, no tokenizer."""
    folder = tmp_path_factory.mktemp("config-only")
    shutil.copy(tiny_hermes / "config.json", folder / "config.json")
    return folder


def expert_tensors(model) -> list:
    return [w for moe in model.moe_layers() for w in (moe.w13, moe.w2)]


def layout(model) -> dict[str, tuple]:
    """Every tensor the model serves with: name -> (shape, dtype, device type)."""
    out = {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in model.state_dict().items()}
    for i, w in enumerate(expert_tensors(model)):
        parts = {"data": w.data, "scales": w.scales} if isinstance(w, MXFP8Tensor) else {"": w}
        for part, t in parts.items():
            out[f"expert{i}.{part}"] = (tuple(t.shape), t.dtype, t.device.type)
    return out


def test_a_folder_with_only_a_config_serves(config_only):
    engine = NativeEngine(str(config_only), EngineConfig(load_format="dummy", device="cpu", dtype="float32",
                                                         kv_cache_tokens=2048, max_model_len=1024))
    params = SamplingParams(max_tokens=6, temperature=0.0)

    async def one(prompt):
        return [t.id async for t in engine.generate(prompt, params)]

    async def main():
        return await asyncio.gather(one([5, 6, 7, 8]), one(list(range(10, 50))))

    try:
        outs = asyncio.run(main())
    finally:
        asyncio.run(engine.stop())
    vocab = json.loads((config_only / "config.json").read_text())["vocab_size"]
    assert [len(o) for o in outs] == [6, 6]
    assert all(0 <= t < vocab for o in outs for t in o)
    assert "experts none" in engine.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", ["none", "mxfp8"])
def test_same_tensors_as_the_loader_gives(tiny_hermes, dtype, quant):
    loaded = load_model(tiny_hermes, dtype=dtype, quant=quant)
    dummy = random_model(tiny_hermes, device="cpu", dtype=dtype, quant=quant)
    assert type(dummy) is type(loaded) and not dummy.training
    assert layout(dummy) == layout(loaded)
    assert [type(w) for w in expert_tensors(dummy)] == [type(w) for w in expert_tensors(loaded)]
    assert dummy.weight_bytes() == loaded.weight_bytes()


def test_mxfp8_experts_are_mxfp8_tensors(config_only):
    model = random_model(config_only, dtype=torch.bfloat16, quant="mxfp8")
    experts = expert_tensors(model)
    assert experts and all(isinstance(w, MXFP8Tensor) for w in experts)
    assert all(w.data.dtype == torch.float8_e4m3fn for w in experts)
    assert all(torch.isfinite(w.dequantize(torch.float32)).all() for w in experts)


def test_values_are_small_and_seeded(config_only):
    cfg = json.loads((config_only / "config.json").read_text())
    model = random_model(config_only, dtype=torch.float32)
    layer = model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(cfg["hidden_size"]))
    assert torch.equal(layer.self_attn.q_norm.weight, torch.ones(cfg["head_dim"]))
    assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.1)
    # experts: unit variance per output after the matmul, as a trained layer roughly has
    assert layer.mlp.w13.std().item() == pytest.approx(cfg["hidden_size"] ** -0.5, rel=0.1)
    assert layer.mlp.w2.std().item() == pytest.approx(cfg["moe_intermediate_size"] ** -0.5, rel=0.1)
    again, other = random_model(config_only, dtype=torch.float32), random_model(config_only, dtype=torch.float32,
                                                                                seed=1)
    assert torch.equal(again.layers[0].mlp.w13, layer.mlp.w13)
    assert torch.equal(again.embed_tokens.weight, model.embed_tokens.weight)
    assert not torch.equal(other.layers[0].mlp.w13, layer.mlp.w13)


def test_biases_are_zero(tmp_path, config_only):
    cfg = json.loads((config_only / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    model = random_model(tmp_path, dtype=torch.float32)
    assert torch.equal(model.layers[0].self_attn.q_proj.bias, torch.zeros_like(model.layers[0].self_attn.q_proj.bias))


def test_unknown_quant_is_refused(config_only):
    with pytest.raises(ValueError, match="quant"):
        random_model(config_only, quant="int4")


def test_cli_flags_reach_the_engine_config(monkeypatch, config_only):
    import serve.engine.native as native
    from serve.cli import _local_engine, build_parser

    seen = {}

    class FakeEngine:
        def __init__(self, model_dir, config):
            seen["config"] = config

        def describe(self):
            return "fake"

    monkeypatch.setattr(native, "NativeEngine", FakeEngine)
    args = build_parser().parse_args(["--model", str(config_only), "--load-format", "dummy", "--enforce-eager"])
    _local_engine(args, config_only)
    assert seen["config"].load_format == "dummy" and seen["config"].enforce_eager
    args = build_parser().parse_args(["--model", str(config_only)])
    _local_engine(args, config_only)
    assert seen["config"].load_format == "auto" and not seen["config"].enforce_eager


def test_cli_refuses_dummy_weights_for_other_engines(config_only, capsys):
    from serve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model", str(config_only), "--engine", "hf", "--load-format", "dummy"])
    assert e.value.code == 2 and "--load-format dummy needs --engine native" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_model_is_never_allocated_twice_on_a_gpu(config_only):
    """Peak memory while building: the model plus one layer's bf16 experts (quantized away at once)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = random_model(config_only, device="cuda", dtype=torch.bfloat16, quant="mxfp8")
    cfg = model.cfg
    dense, experts = model.weight_bytes()
    one_layer_bf16 = 3 * cfg.num_experts * cfg.moe_intermediate_size * cfg.hidden_size * 2
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= dense + experts + 2 * one_layer_bf16 + (8 << 20)
