"""Tiny random checkpoints for train tests (built once per session)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from serve.tiny import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", template="hermes")


@pytest.fixture(autouse=True)
def _no_triton_interpreter(monkeypatch):
    """tests/kernels turns the Triton interpreter on for the whole session; servers and trainers here
    would then run MXFP8 experts through it (minutes per episode) instead of the CPU path users get."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="session")
def expert_data(tiny, tmp_path_factory) -> Path:
    """The scripted expert's first 4 synthetic-small tasks recorded for `tiny` (sessions/, report.json), once
    per session: test_expert_data, test_teacher and test_timings read the same recording (each recorded its
    own before, ~5-10 s apiece). Read-only: a test that changes a session works on a copy."""
    out = tmp_path_factory.mktemp("expert") / "data"
    r = record_expert(tiny, out, 4)
    assert r.returncode == 0, r.stderr
    return out


def record_expert(model: Path, out: Path, limit: int) -> subprocess.CompletedProcess:
    """`composer-train expert-data synthetic-small`: the scripted expert's first `limit` tasks, recorded
    token-exact for `model` into `out` (sessions/ and report.json)."""
    return subprocess.run([sys.executable, "-m", "train.cli", "expert-data", "synthetic-small", "--model", str(model),
                           "--out", str(out), "--limit", str(limit), "--concurrency", "2"], capture_output=True,
                          text=True, timeout=600, cwd=out.parent)
