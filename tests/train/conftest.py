"""Tiny random checkpoints for train tests (built once per session)."""

from __future__ import annotations

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
