"""Checkpoints other libraries read right or refuse: MXFP8 experts in the compressed-tensors layout.

Checked against the compressed-tensors package itself (its MXFP8A16 preset and its MXFP8 compressor),
against transformers (which cannot decompress MXFP8 experts and must refuse, never load garbage), and
through `composer-train export`, whose plain copy transformers loads with our fp32 logits.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kernels import MXFP8Tensor
from serve.model import ct_format
from serve.model.config import UnsupportedModel
from serve.model.loader import load_model
from train.cli import main as train_main
from train.trainer import Trainer, TrainerConfig

ct = pytest.importorskip("compressed_tensors")

IDS = torch.tensor([[3, 17, 300, 42, 9, 100, 7, 7, 250, 11, 64, 5]])


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory) -> Path:
    """A checkpoint composer-train wrote after a real optimizer step with MXFP8 experts."""
    from tests.train.test_trainer import fixed_samples

    trainer = Trainer(tiny, TrainerConfig(lr=3e-3, mxfp8_experts=True))
    trainer.step(fixed_samples(tiny), [1.0, -0.5, -0.5])
    return trainer.save(tmp_path_factory.mktemp("ct") / "step1")


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_config_is_the_packages_mxfp8a16_scheme(trained):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    raw = json.loads((trained / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(raw)
    assert parsed.format == "mxfp8-quantized" and parsed.quant_method == "compressed-tensors"
    (group,) = parsed.config_groups.values()
    assert group.weights == preset_name_to_scheme("MXFP8A16", ["Linear"]).weights
    assert group.input_activations is None
    compressor = BaseCompressor.get_value_from_registry(parsed.format)
    assert compressor.can_compress(torch.nn.Linear, group)
    assert "export" in (trained / "README.md").read_text()


def test_experts_decompress_with_the_package_to_what_is_served(trained):
    """Every expert projection, decompressed by compressed-tensors' own MXFP8 compressor, equals what
    composer-serve computes with, bit for bit; and the package compresses those values back to our codes."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig.model_validate(json.loads((trained / "config.json").read_text())["quantization_config"])
    (scheme,) = cfg.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(cfg.format)
    tensors = _tensors(trained)
    served = load_model(trained, dtype=torch.float32, quant="none")
    moe = served.layers[0].mlp
    assert isinstance(moe.w13, MXFP8Tensor)
    w13, w2 = moe.w13.dequantize(torch.float32), moe.w2.dequantize(torch.float32)
    inter = w13.shape[1] // 2
    checked = 0
    for e in range(w13.shape[0]):
        for name, ours in (("gate_proj", w13[e, :inter]), ("up_proj", w13[e, inter:]), ("down_proj", w2[e])):
            pre = f"model.layers.0.mlp.experts.{e}.{name}."
            stored = {"weight": tensors[pre + "weight"], "weight_scale": tensors[pre + "weight_scale"]}
            assert stored["weight"].dtype == torch.float8_e4m3fn and stored["weight_scale"].dtype == torch.uint8
            assert stored["weight_scale"].shape == (ours.shape[0], ours.shape[1] // 32)
            theirs = compressor.decompress(stored, scheme)["weight"]
            assert torch.equal(theirs.float(), ours)
            scale = compressor._decompress_scale(stored["weight_scale"]).float()
            again = compressor.compress({"weight": ours, "weight_scale": scale}, scheme)
            assert torch.equal(again["weight"].view(torch.uint8), stored["weight"].view(torch.uint8))
            checked += 1
    assert checked == 3 * w13.shape[0]


def test_loader_reads_both_layouts_alike(trained, tmp_path):
    """Today's per-expert layout and the fused one train/ wrote before it give the same logits."""
    import shutil

    from safetensors.torch import save_file

    new = load_model(trained, dtype=torch.float32, quant="none")
    old_dir = tmp_path / "fused"
    shutil.copytree(trained, old_dir)
    cfg = json.loads((old_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (old_dir / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in _tensors(trained).items() if ".mlp.experts." not in k}
    for i, layer in enumerate(new.layers):
        for which, w in (("gate_up_proj", layer.mlp.w13), ("down_proj", layer.mlp.w2)):
            tensors[f"model.layers.{i}.mlp.experts.{which}"] = w.data.contiguous()
            tensors[f"model.layers.{i}.mlp.experts.{which}_scale"] = w.scales.view(torch.uint8).contiguous()
    save_file(tensors, str(old_dir / "model.safetensors"))
    old = load_model(old_dir, dtype=torch.float32, quant="none")
    with torch.no_grad():
        assert torch.equal(new.forward_train(IDS), old.forward_train(IDS))


def test_other_quantizations_are_refused_by_name(trained, tmp_path):
    import shutil

    fp8 = tmp_path / "fp8-channel"
    shutil.copytree(trained, fp8)
    cfg = json.loads((fp8 / "config.json").read_text())
    weights = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.update(strategy="channel", group_size=None, scale_dtype=None)
    cfg["quantization_config"]["format"] = "float-quantized"
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="float-quantized.*float8/channel"):
        load_model(fp8, dtype=torch.float32)


def _load_in_transformers(ckpt: Path, *, without_ct: bool = False) -> subprocess.CompletedProcess:
    """AutoModelForCausalLM.from_pretrained in a fresh interpreter; `without_ct` gives it a site folder
    holding every installed package except compressed-tensors (really missing, not patched out)."""
    code = ("import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(ckpt)!r}, dtype=torch.float32)\n"
            f"print('LOGITS', m(torch.tensor({IDS.tolist()})).logits.flatten()[:4].tolist())\n")
    env = dict(os.environ)
    argv = [sys.executable, "-c", code]
    if without_ct:
        site_dir = ckpt.parent / "site-without-ct"
        site_dir.mkdir(exist_ok=True)
        for entry in Path(site.getsitepackages()[0]).iterdir():
            if not entry.name.startswith("compressed_tensors") and not (site_dir / entry.name).exists():
                (site_dir / entry.name).symlink_to(entry)
        root = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = f"{site_dir}{os.pathsep}{root}"
        argv = [sys.executable, "-S", "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)


def test_transformers_refuses_mxfp8_experts_instead_of_loading_garbage(trained):
    """transformers 5 folds fused-expert fp8 scales as if per channel and cannot take group-32 scales: the
    load must fail (it did load, silently wrong, when nothing in config.json named the quantization)."""
    got = _load_in_transformers(trained)
    assert got.returncode != 0 and "LOGITS" not in got.stdout, got.stdout[-2000:]
    assert "CompressedTensorsDequantize" in got.stderr and "mlp.experts" in got.stderr, got.stderr[-2000:]


def test_transformers_without_the_package_names_it(trained):
    got = _load_in_transformers(trained, without_ct=True)
    assert got.returncode != 0 and "LOGITS" not in got.stdout
    assert "pip install compressed-tensors" in got.stderr, got.stderr[-2000:]


def test_export_is_what_transformers_loads_with_our_logits(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "plain"
    assert train_main(["export", str(trained), "--out", str(out), "--dtype", "fp32"]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "float32"
    assert all(t.dtype == torch.float32 for t in _tensors(out).values())
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    served = load_model(trained, dtype=torch.float32, quant="none")
    with torch.no_grad():
        ours, theirs = served.forward_train(IDS), hf(IDS).logits
    assert (ours - theirs).abs().max() < 1e-4, (ours - theirs).abs().max()
    assert train_main(["export", str(trained), "--out", str(tmp_path / "bf16")]) == 0
    assert next(AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").parameters()).dtype == torch.bfloat16
    assert train_main(["export", str(tmp_path / "nowhere"), "--out", str(out)]) == 2


def test_builtin_model_ships_in_the_layout():
    builtin = Path(__file__).resolve().parents[2] / "serve" / "builtin" / "composer-tiny"
    qc = json.loads((builtin / "config.json").read_text())["quantization_config"]
    assert qc == ct_format.quantization_config()
    names = set(_tensors(builtin))
    assert "model.layers.0.mlp.experts.7.down_proj.weight_scale" in names
    assert not any(n.endswith("gate_up_proj") for n in names)


def test_hf_engine_refuses_mxfp8_experts_and_names_the_export(trained):
    from serve.engine.hf import HFEngine

    with pytest.raises(ValueError, match="composer-train export"):
        HFEngine(str(trained), dtype="float32", device="cpu")


def test_a_server_on_mxfp8_experts_takes_plain_weights_of_the_same_shape(trained, tmp_path):
    """Weight sync between checkpoints that store experts differently (a --no-mxfp8 run from an MXFP8 base):
    the quantization_config differs, the shape does not, so the running engine accepts the folder."""
    from serve.engine.native import EngineConfig, NativeEngine
    from serve.engine.weights import WeightLoadError

    plain = tmp_path / "plain"
    assert train_main(["export", str(trained), "--out", str(plain), "--dtype", "fp32"]) == 0
    engine = NativeEngine(str(trained), EngineConfig(dtype="float32", kv_cache_tokens=1024))
    engine._check_fits(plain)
    cfg = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    with pytest.raises(WeightLoadError, match="num_hidden_layers"):
        engine._check_fits(plain)  # a shape change is still refused
