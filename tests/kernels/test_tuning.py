"""Per-GPU tuned tables (kernels/tuning.py): their schema, the lookup for a (fake) device without a GPU, the
fallback on a missing or corrupt table, the kernels taking the table's choice, and bench/gpu.py --tune's
sweep run end to end at a tiny shape under the interpreter."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from kernels import MXFP8Tensor, moe_forward, moe_reference, tuning
from kernels.launches import on_launch
from kernels.op_count import OpCounter
from tests.kernels.moe_data import make_layer

ROOT = Path(__file__).resolve().parents[2]
FAKE = "Fake GPU 9000 (80GB)"
TILES = {"block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 3}


def moe_key(T: int, **kw) -> str:
    dims = dict(T=T, D=64, I=32, E=16, K=2) | kw
    return tuning.shape_key("moe_decode", "fp32", **dims)


def fp8_cfg(block_n: int) -> dict:
    return {"block_m": 16, "block_n": block_n, "block_k": 128, "split_k": 2, "num_warps": 4, "num_stages": 4}


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """A folder of tables that the kernels read as if this machine were FAKE."""
    monkeypatch.setenv(tuning.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(tuning.DEVICE_ENV, FAKE)
    tuning.reload()
    yield tmp_path
    tuning.reload()


def test_names_and_keys_are_canonical():
    assert tuning.normalise("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert tuning.normalise(" NVIDIA  H200 ") == "nvidia-h200"
    key = tuning.shape_key("moe_decode", "bf16", T=8, D=2048, I=768, E=128, K=8)
    assert key == "D=2048,E=128,I=768,K=8,T=8,dtype=bf16"
    assert tuning.parse_key("moe_decode", key) == ({"D": 2048, "E": 128, "I": 768, "K": 8, "T": 8}, "bf16")
    for bad in ("T=8,D=2048", "D=2048,E=128,I=768,K=8,T=8,dtype=int4", "T=8,D=2048,E=128,I=768,K=8,dtype=bf16",
                "D=2048,E=128,I=768,K=8,T=x,dtype=bf16"):
        with pytest.raises(ValueError):
            tuning.parse_key("moe_decode", bad)
    with pytest.raises(ValueError, match="dimensions"):
        tuning.shape_key("fp8_linear", "bf16", M=1, N=2)
    with pytest.raises(ValueError, match="unknown kernel"):
        tuning.shape_key("attention", "bf16", M=1)


def test_a_fake_devices_table_is_written_validated_and_looked_up(tmp_path):
    entries = {"moe_decode": {moe_key(1): {"variant": "dot", "split_k": 2, "gate_up": TILES, "down": TILES},
                              moe_key(8): {"variant": "default"}},
               "fp8_linear": {tuning.shape_key("fp8_linear", "bf16", M=8, N=64, K=256): fp8_cfg(32),
                              tuning.shape_key("fp8_linear", "bf16", M=32, N=64, K=256): fp8_cfg(64)}}
    path = tuning.write_table(tuning.Table(FAKE, entries, {"date": "2026-11-27"}), tmp_path)
    assert path.name == "fake-gpu-9000-80gb.json"
    assert tuning.validate(json.loads(path.read_text())).entries == entries

    def moe(T, **kw):
        return tuning.lookup("moe_decode", "fp32", device_name=FAKE, folder=tmp_path, **(dict(T=T, D=64, I=32, E=16, K=2) | kw))

    assert moe(1)["split_k"] == 2 and moe(8)["variant"] == "default"
    assert moe(4)["variant"] == "default"  # a count between two tuned ones takes the next tuned one above
    assert moe(9) is None  # past the largest: defaults
    assert moe(1, D=128) is None  # another shape
    assert tuning.lookup("moe_decode", "bf16", device_name=FAKE, folder=tmp_path, T=1, D=64, I=32, E=16, K=2) is None

    def fp8(M):
        return tuning.lookup("fp8_linear", "bf16", device_name=FAKE, folder=tmp_path, M=M, N=64, K=256)

    assert fp8(1)["block_n"] == 32 and fp8(9)["block_n"] == 64 and fp8(33) is None
    assert tuning.lookup("fp8_linear", "bf16", device_name="Other GPU", folder=tmp_path, M=1, N=64, K=256) is None


def test_without_a_gpu_or_a_named_device_no_table_is_read(monkeypatch):
    monkeypatch.delenv(tuning.DEVICE_ENV, raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU's table is read on a GPU")
    assert tuning.current_device_name() is None
    assert tuning.lookup("fp8_linear", "bf16", M=1, N=64, K=256) is None


@pytest.mark.parametrize("fault, text", [
    ("{not json", "Expecting"),
    (json.dumps({"schema": 2, "device": FAKE, "entries": {}}), "schema must be 1"),
    (json.dumps({"schema": 1, "device": FAKE, "entries": {"moe_decode": {moe_key(1): {"variant": "magic"}}}}),
     "variant must be one of"),
    (json.dumps({"schema": 1, "device": FAKE, "entries": {"moe_decode": {moe_key(1): {"variant": "dot", "split_k": 1,
                                                                                       "gate_up": TILES}}}}),
     "needs a 'down' object"),
    (json.dumps({"schema": 1, "device": FAKE, "entries": {"moe_decode": {moe_key(1): {
        "variant": "dot", "split_k": 2, "gate_up": TILES, "down": TILES, "fused": True}}}}), "takes no split_k"),
    (json.dumps({"schema": 1, "device": FAKE, "entries": {"fp8_linear": {
        tuning.shape_key("fp8_linear", "bf16", M=1, N=64, K=256): fp8_cfg(0)}}}), "block_n must be a positive int"),
])
def test_a_corrupt_table_means_the_defaults_and_one_warning(table_dir, fault, text):
    (table_dir / f"{tuning.normalise(FAKE)}.json").write_text(fault)
    with pytest.warns(RuntimeWarning, match=text) as got:
        assert tuning.lookup("moe_decode", "fp32", T=1, D=64, I=32, E=16, K=2) is None
    assert len(got) == 1 and "using the default configurations" in str(got[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the next lookup is silent
        assert tuning.lookup("moe_decode", "fp32", T=2, D=64, I=32, E=16, K=2) is None


def test_the_fp8_kernel_takes_its_tiles_from_the_table(table_dir):
    from kernels.fp8_linear_triton import tiles

    cpu = torch.device("cpu")
    before = tiles(8, 64, 256, cpu, interpret=False)  # no table yet: today's guess
    key = tuning.shape_key("fp8_linear", "bf16", M=8, N=64, K=256)
    tuning.write_table(tuning.Table(FAKE, {"fp8_linear": {key: fp8_cfg(32)}}))
    assert tiles(8, 64, 256, cpu, interpret=False) == (16, 32, 128, 2, 4, 4) != before
    assert tiles(8, 64, 256, cpu, interpret=False, dtype=torch.float16) == before  # another dtype's key


def test_the_moe_seam_runs_the_variant_the_table_names(table_dir, device):
    """moe_forward on the Triton path with the table's entries: the variant it names (the decode variants at 17
    tokens, where today's path is align + the grouped kernels: tests/kernels/test_moe_decode.py; the grouped
    kernels at 3; the fused kernel at 2), each matching the reference and without a host sync."""
    shapes = {3: (16, 2), 17: (16, 1), 2: (16, 2)}

    def launches(T):
        E, K = shapes[T]
        x, ids, w, w13, w2 = make_layer(T, E, K, 64, 32, seed=T)
        q13, q2 = MXFP8Tensor.quantize(w13, backend="torch"), MXFP8Tensor.quantize(w2, backend="torch")
        got: list[str] = []
        with torch.inference_mode(), on_launch(got.append), OpCounter(strict=True):
            out = moe_forward(x.to(device), ids.to(device), w.to(device), MXFP8Tensor(q13.data.to(device), q13.scales.to(device)),
                              MXFP8Tensor(q2.data.to(device), q2.scales.to(device)), backend="triton")
        ref = moe_reference(x, ids, w, q13, q2)
        tol = 1e-5 if device.type == "cpu" else 3e-2
        torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        return got

    dtype = "fp32"  # make_layer's activations, on either device
    wide = TILES | {"block_n": 32}  # fewer programs: the interpreter pays per program
    split = {"variant": "fma", "split_k": 2, "gate_up": wide, "down": wide}
    tuning.write_table(tuning.Table(FAKE, {"moe_decode": {
        tuning.shape_key("moe_decode", dtype, T=17, D=64, I=32, E=16, K=1): split,
        tuning.shape_key("moe_decode", dtype, T=3, D=64, I=32, E=16, K=2): {"variant": "grouped"},
        tuning.shape_key("moe_decode", dtype, T=2, D=64, I=32, E=16, K=2): {
            "variant": "dot", "split_k": 1, "gate_up": wide, "down": wide, "fused": True}}}))
    assert launches(17) == ["moe_decode_gate_up", "moe_decode_down"]
    assert launches(2) == ["moe_decode_fused", "moe_decode_sum"]  # gate_up and down in one launch
    assert launches(3) == ["moe_align", "moe_gate_up", "moe_down"]


def test_every_committed_table_is_valid_and_named_after_its_device():
    for path in sorted(tuning.TUNED_DIR.glob("*.json")):
        table = tuning.validate(json.loads(path.read_text()))
        assert path.name == f"{tuning.normalise(table.device)}.json", path
        assert table.meta.get("date") and table.meta.get("triton"), path  # who measured it, with what


def test_the_tune_section_sweeps_writes_and_reports_at_a_tiny_shape(tmp_path, monkeypatch):
    """bench/gpu.py --tune's section under the interpreter (tiny shape, tiny candidate list, wall-clock
    timing): a valid table in --out (never kernels/tuned/ on a CPU) with an entry per token count that the
    lookup finds, the layer rows checked against today's path, and each kernel's bandwidth rows."""
    import argparse
    import importlib.util
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_gpu_tune_test", ROOT / "bench" / "gpu.py")
    g = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu_tune_test", g)
    spec.loader.exec_module(g)
    if g.CUDA:
        pytest.skip("on a GPU the sweep is bench/gpu.py --tune's full one")
    before = sorted(tuning.TUNED_DIR.glob("*.json"))
    plan = g.Plan(argparse.Namespace(layers=1, quick=True))
    report = g.Report(tmp_path / "gpu.json", {})
    g.section_tune(plan, report, tmp_path)
    sec = report.data["sections"]["tune"]
    assert not sec["errors"] and not sec["failed_candidates"], sec
    assert sorted(tuning.TUNED_DIR.glob("*.json")) == before and sec["table"] == str(tmp_path / "cpu-interpreter.json")
    table = tuning.validate(json.loads(Path(sec["table"]).read_text()))
    assert set(table.entries["moe_decode"]) == {tuning.shape_key("moe_decode", "fp32", T=T, D=64, I=32, E=8, K=2)
                                                for T in (1, 3)}
    assert tuning.lookup("moe_decode", "fp32", device_name="cpu-interpreter", folder=tmp_path, T=2, D=64, I=32, E=8, K=2) \
        == table.entries["moe_decode"][tuning.shape_key("moe_decode", "fp32", T=3, D=64, I=32, E=8, K=2)]
    layers = [r for r in sec["rows"] if r["kind"] == "moe_layer"]
    assert [r["tokens"] for r in layers] == [1, 3]
    assert all(r["max_rel_gap"] < 1e-4 and r["default_us"] > 0 and r["best"] for r in layers)
    kernels = [r for r in sec["rows"] if r["kind"] == "moe_kernel"]
    assert {(r["tokens"], r["kernel"]) for r in kernels} >= {(T, k) for T in (1, 3) for k in ("gate_up", "down")}
    # bytes of the experts actually routed: gate_up reads twice down's rows of D x I codes (+1/32 scales)
    for r in kernels:
        assert r["gb_s"] > 0 and round(r["expert_mb"] * 1e6) % (64 * 32 * 33 // 32) == 0
    assert sec["plot"] is None or Path(sec["plot"]).stat().st_size > 1000  # None: no matplotlib here
    fp8 = [r for r in sec["rows"] if r["kind"] == "fp8"]
    assert [r["M"] for r in fp8] == [1, 4] and all(r["max_rel_gap"] < 1e-4 for r in fp8)
    assert set(table.entries["fp8_linear"]) == {tuning.shape_key("fp8_linear", "fp32", M=M, N=64, K=256) for M in (1, 4)}
