"""Building our C++ CPU kernels: what a machine without the build does."""

from __future__ import annotations

import importlib
import shutil

import pytest
import torch

from kernels import cpu_attention, cpu_ext


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_a_machine_without_the_build_runs_torch_and_builds_it_in_the_background(tmp_path, monkeypatch):
    """What a first server start does: no build -> None (the torch paths) and one background build, which
    the next start then loads. A build of its own in an empty cache folder (~30-60 s)."""
    monkeypatch.setenv("COMPOSER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("COMPOSER_KERNEL_BUILD", "1")  # tests/conftest.py switches it off for everything else
    fresh = importlib.reload(cpu_ext)  # module state (the loaded kernels, the build process) reset
    try:
        assert fresh.load() is None
        assert fresh.load() is None  # still building: one build process, not two
        proc = fresh._background
        assert proc is not None
        assert proc.wait(timeout=280) == 0
        assert fresh.build_dir().parent == tmp_path
        loaded = fresh.load(build_in_background=False)
        assert loaded is not None
        q, k, v = torch.randn(1, 2, 32), torch.randn(32, 2, 32), torch.randn(32, 2, 32)
        tables, lens = torch.tensor([[1, 0]]), torch.tensor([20])
        torch.testing.assert_close(loaded.paged_decode_attention(q, k, v, tables, lens, 16, 32**-0.5),
                                   cpu_attention.reference(q, k, v, tables, lens, 16), atol=2e-6, rtol=1e-5)
    finally:
        monkeypatch.undo()
        importlib.reload(cpu_ext)


def test_no_background_build_when_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPOSER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("COMPOSER_KERNEL_BUILD", "0")
    fresh = importlib.reload(cpu_ext)
    try:
        assert fresh.load() is None
        assert fresh._background is None
        assert not any(tmp_path.iterdir())
    finally:
        monkeypatch.undo()
        importlib.reload(cpu_ext)
