"""What a person runs prints our lines, not third-party chatter: `python -m serve.tiny` and `composer-train`
without torchao's failed extension loads, torch's pytree deprecation notices or a progress bar, and
composer-serve's start-up line without a "not packed" that says nothing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NOISE = re.compile(r"Failed to load|^[WE]\d{4} |is deprecated|it/s\]|Writing model shards", re.M)


def run(*cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(list(cmd), capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao (the dev extra) is what logs")
def test_serve_tiny_and_composer_train_print_no_third_party_chatter(tmp_path):
    p = run(sys.executable, "-m", "serve.tiny", str(tmp_path / "tiny"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert NOISE.findall(p.stdout + p.stderr) == [], p.stdout + p.stderr
    assert p.stdout.startswith("wrote a tiny random Qwen3-MoE checkpoint") and p.stderr == ""
    session = tmp_path / "empty.jsonl"
    session.write_text('{"type": "session", "id": "s", "tools": []}\n')
    q = run(str(BIN / "composer-train"), "check", str(session), "--model", str(tmp_path / "tiny"), cwd=tmp_path)
    assert NOISE.findall(q.stdout + q.stderr) == [], q.stdout + q.stderr
    assert q.returncode == 1 and "no sampled tokens to check" in q.stdout  # nothing checked is not "ok"


def test_the_start_up_line_says_nothing_about_packing_it_did_not_do(tmp_path):
    from serve.engine.native import EngineConfig, NativeEngine
    from serve.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny")
    engine = NativeEngine(str(ckpt), EngineConfig(dtype="float64", kv_cache_tokens=1024))  # no oneDNN for float64
    try:
        line = engine.describe()
    finally:
        import asyncio

        asyncio.run(engine.stop())
    assert "not packed" not in line and "float64" in line
