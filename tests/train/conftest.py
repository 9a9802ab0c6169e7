"""Tiny random checkpoints for train tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve.tiny import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", template="hermes")
