"""The memory plan (train/memory_plan.py): its arithmetic at Qwen3-30B-A3B, the refusal, and the step's part
checked against peaks measured on a CPU (one process; FSDP2 on two gloo ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve.model.config import QWEN3_30B_A3B, ModelConfig
from train.cli import main as train_main
from train.memory_plan import GIB, PlanDoesNotFit, memory_plan, parameter_counts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def qwen30b(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return tmp_path


def test_parameter_count_is_the_models(qwen30b):
    n = parameter_counts(ModelConfig.from_dir(qwen30b))
    assert abs(n["total"] - 30.53e9) / 30.53e9 < 0.01  # Qwen3-30B-A3B: 30.5 B parameters
    assert n["experts"] == 48 * 128 * 3 * 2048 * 768


def test_30b_needs_sharding_and_checkpointing_on_80_gib(qwen30b):
    cfg = ModelConfig.from_dir(qwen30b)
    one = memory_plan(cfg, micro_batch_tokens=4096)
    assert one.total > 480 * GIB  # 16 bytes per parameter of masters, gradients and moments alone
    with pytest.raises(PlanDoesNotFit, match="more ranks"):
        one.check(80 * GIB)
    eight = memory_plan(cfg, world=8, fsdp=True, micro_batch_tokens=4096)
    with pytest.raises(PlanDoesNotFit, match="activation-checkpointing"):
        eight.check(80 * GIB)  # every layer's activations kept for the backward: ~15 GiB
    eight.check(141 * GIB)  # 8 H200s hold it as it is
    assert "MXFP8 experts (1 layer)" in eight.table()  # quantized again in each layer's backward under FSDP
    ckpt = memory_plan(cfg, world=8, fsdp=True, micro_batch_tokens=4096, activation_checkpointing=True)
    assert ckpt.total < eight.total - 10 * GIB
    ckpt.check(80 * GIB)  # and 8 H100s with activation checkpointing
    sixteen = memory_plan(cfg, world=16, fsdp=True, micro_batch_tokens=4096, activation_checkpointing=True)
    sixteen.check(80 * GIB)  # and 16 H100s


def test_cli_prints_the_plan_and_exits_1_when_it_cannot_fit(qwen30b, capsys):
    assert train_main(["plan", "--model", str(qwen30b), "--ranks", "8", "--gpu-memory", "80"]) == 1
    out, err = capsys.readouterr()
    assert "memory plan per rank (FSDP over 8 ranks)" in out and "master weights" in out
    assert "GiB per rank" in err and "--activation-checkpointing" in err
    assert train_main(["plan", "--model", str(qwen30b), "--ranks", "16", "--gpu-memory", "80",
                       "--activation-checkpointing", "--micro-batch-tokens", "4096", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["fits"] and got["world"] == 16 and got["per_rank_bytes"] < 80 * GIB


def _measured(tmp_path: Path, ranks: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / f"probe{ranks}.json"
    argv = [sys.executable, str(ROOT / "tests" / "train" / "memory_probe.py"), str(out)] + \
        (["--ranks", str(ranks)] if ranks > 1 else [])
    subprocess.run(argv, check=True, env=env, cwd=tmp_path, timeout=600, capture_output=True)
    return json.loads(out.read_text())


def _plan_of(probe: dict, tmp_path: Path, ranks: int):
    (tmp_path / "config.json").write_text(json.dumps(probe["shape"]))
    tokens = probe["seqs"] // ranks * probe["len"]  # each rank's one micro-batch
    scored = tokens if ranks > 1 else tokens // 2  # FSDP scores every position; one process the trained half
    return memory_plan(ModelConfig.from_dir(tmp_path), world=ranks, fsdp=ranks > 1, compute_bytes=4,
                       micro_batch_tokens=tokens, scored_tokens=scored, on_gpu=False)


def test_plan_bounds_a_measured_step_in_one_process(tmp_path):
    probe = _measured(tmp_path, 1)
    plan = _plan_of(probe, tmp_path, 1)
    (measured,) = probe["step_bytes"]
    assert 0.55 * plan.step_bytes <= measured <= plan.step_bytes, (measured / GIB, plan.table())


@pytest.mark.slow
def test_plan_bounds_a_measured_step_on_two_gloo_ranks(tmp_path):
    probe = _measured(tmp_path, 2)
    plan = _plan_of(probe, tmp_path, 2)
    for measured in probe["step_bytes"]:
        assert 0.55 * plan.step_bytes <= measured <= plan.step_bytes, (measured / GIB, plan.table())
