"""bench/gpu.py end to end at its reduced CPU shape: every section runs and its JSON holds plausible figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bench")
    # the reduced shape even on a GPU machine: the full one takes minutes
    # ... and without the Triton interpreter tests/kernels leaves on: the decode section would run the static
    # step's kernels through it, past its time budget (the kernels section turns it on for itself)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    files = list(out.glob("gpu-*-cpu-reduced.json"))
    return done, json.loads(files[0].read_text()) if len(files) == 1 else None


def test_every_section_runs(run):
    done, data = run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "REDUCED CPU SHAPE" in done.stdout and "wrote " in done.stdout
    assert data["meta"]["reduced_cpu_shape"] and data["meta"]["versions"]["torch"]
    sections = data["sections"]
    assert set(sections) == {"parity", "decode", "hf", "profile", "spec", "kernels", "fp8", "train", "tests"}
    for name, sec in sections.items():
        assert sec["status"] == "ok" and not sec["errors"] and sec["rows"], (name, sec)


def test_parity_figures(run):
    rows = {r["variant"]: r for r in run[1]["sections"]["parity"]["rows"]}
    assert set(rows) == {"transformers bf16 (baseline)", "engine float32/none", "engine bfloat16/none",
                         "engine bfloat16/mxfp8", "engine float32/mxfp8"}
    exact = rows["engine float32/none"]
    assert exact["logit_gap"] < 1e-3 and exact["seq_same"] == exact["seqs"] > 0  # float32 = transformers
    for r in rows.values():
        assert 0 <= r["logit_gap"] < 10 and 0 <= r["tok_same"] <= r["tokens"]
    assert rows["engine bfloat16/none"]["logit_gap"] > exact["logit_gap"]


def test_decode_prefill_and_transformers_figures(run):
    sections = run[1]["sections"]
    decode = [r for r in sections["decode"]["rows"] if r["kind"] == "decode"]
    got = {(r["experts"], r["engine"], r["batch"]) for r in decode}
    assert got == {(q, e, b) for q in ("mxfp8", "none") for e in ("default", "eager") for b in (1, 4)}
    for r in decode:
        assert 0 < r["step_ms"] < 10_000 and r["interval_ms"] >= r["step_min_ms"] > 0 and r["decode_steps"] >= 3
        assert r["tok_s"] == pytest.approx(r["batch"] * 1e3 / r["interval_ms"])
    prefill = [r for r in sections["decode"]["rows"] if r["kind"] == "prefill"]
    assert {r["experts"] for r in prefill} == {"mxfp8", "none"} and all(r["tok_s"] > 0 for r in prefill)
    assert [r["batch"] for r in sections["hf"]["rows"]] == [1, 4]
    assert all(r["step_ms"] > 0 and r["tok_s"] > 0 for r in sections["hf"]["rows"])


def test_profile_and_kernel_figures(run):
    sections = run[1]["sections"]
    prof = sections["profile"]["rows"]
    assert {(r["engine"], r["batch"]) for r in prof} == {(e, b) for e in ("default", "eager") for b in (1, 4)}
    for r in prof:  # a CPU launches no kernels; the engine thread's torch ops were seen
        assert r["steps"] == 3 and r["aten_ops"] > 10 and r["launches"] == 0 and r["syncs"] >= 0
    kernels = sections["kernels"]["rows"]
    assert [r["tokens"] for r in kernels if r["kind"] == "moe"] == [1, 8, 64]
    assert all(r["bf16_ms"] > 0 and r["mxfp8_ms"] > 0 for r in kernels if r["kind"] == "moe")
    assert all(r["gb_s"] > 0 for r in kernels if r["kind"] == "quantizer")


def test_fp8_dense_figures(run):
    rows = run[1]["sections"]["fp8"]["rows"]
    kernels = [r for r in rows if r["kind"] == "kernel"]
    assert {(r["layer"], r["M"]) for r in kernels} == {(n, m) for n in ("qkv", "o", "lm_head") for m in (1, 8, 64)}
    for r in kernels:  # a CPU runs the torch reference: bf16 output against the float32 one
        assert r["bf16_ms"] > 0 and r["fp8_ms"] > 0 and r["fp8_gb_s"] > 0 and r["max_rel_err"] < 1e-2
    decode = [r for r in rows if r["kind"] == "decode"]
    assert {(r["quant_dense"], r["batch"]) for r in decode} == {(q, b) for q in ("none", "fp8") for b in (1, 4)}
    assert all(r["step_ms"] > 0 and r["tok_s"] > 0 for r in decode)
    (gap,) = [r for r in rows if r["kind"] == "logit_gap"]
    assert gap["positions"] == 17 and 0 < gap["mean_abs"] <= gap["max_abs"] and 0 <= gap["greedy_agree"] <= 1
    assert any("dense layers in block FP8" in e["describe"] for e in run[1]["sections"]["fp8"]["engines"])


def test_verify_cost_figures(run):
    rows = run[1]["sections"]["spec"]["rows"]
    costs = [r for r in rows if r["kind"] == "verify"]
    assert {(r["batch"], r["query_tokens"]) for r in costs} == {(b, q) for b in (1, 4) for q in (1, 2, 4, 8)}
    for r in costs:
        assert r["step_ms"] > 0 and r["rows"] == r["batch"] * r["query_tokens"]
        assert r["vs_decode"] == pytest.approx(1.0) if r["query_tokens"] == 1 else r["vs_decode"] > 0
    for r in (r for r in rows if r["kind"] == "projection"):  # from bench/spec-results/fallback/replay/spec.json, when there
        assert r["tokens_per_forward"] >= 1 and r["projected_speedup"] > 0


def test_train_figures(run):
    rows = run[1]["sections"]["train"]["rows"]
    check = next(r for r in rows if r["kind"] == "expert_backward")
    assert max(check["max_rel_err"].values()) < 1e-4  # float32 on a CPU: the grouped backward = autograd
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["activation_checkpointing"] for r in steps] == [False, True]
    for r in steps:
        assert r["step_s"] > 0 and 0 < r["mfu"] < 1 and r["tokens_per_s"] > 0 and r["peak_bytes"] > 0
        assert r["plan_bytes"] > 0 and all(s["quantizations"] == 2 for s in r["steps"])  # 2 MoE layers, once each
        assert set(r["steps"][-1]["phases_s"]) == {"forward", "backward", "optimizer"}


def test_the_gpu_tests_section_reports_counts(run):
    (row,) = run[1]["sections"]["tests"]["rows"]
    assert row["returncode"] == 0 and row["passed"] > 0 and row["failed"] == 0 and not row["failures"]
    assert row["files"] == ["tests/kernels/test_backend.py"]  # on a CPU: the first file, to check the section


def test_unknown_sections_are_refused():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--sections", "decode,speed"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown sections: speed" in done.stderr
