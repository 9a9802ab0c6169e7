"""Building our C++ CPU kernels: what a machine without the build does."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_ext

ROOT = Path(__file__).resolve().parents[2]

# The next server start, in a process of its own: loads the build (never compiles: build_in_background=False
# and a missing build is None) and checks one kernel against the torch reference.
NEXT_START = """
import torch
from kernels import cpu_attention, cpu_ext
loaded = cpu_ext.load(build_in_background=False)
assert loaded is not None, "no build to load"
q, k, v = torch.randn(1, 2, 32), torch.randn(32, 2, 32), torch.randn(32, 2, 32)
tables, lens = torch.tensor([[1, 0]]), torch.tensor([20])
torch.testing.assert_close(loaded.paged_decode_attention(q, k, v, tables, lens, 16, 32**-0.5),
                           cpu_attention.reference(q, k, v, tables, lens, 16), atol=2e-6, rtol=1e-5)
print("loaded", cpu_ext.build_dir())
"""


def _objects_without_the_module(built: Path, cache: Path) -> None:
    """Copy a build folder's objects and ninja state (not the .so, not torch's lock file) into `cache`."""
    cpu_ext.build()  # this session's build: compiled once per machine, shared with the other kernel tests
    into = cache / built.name
    into.mkdir()
    for f in built.iterdir():
        if f.suffix in (".o", ".d") or f.name in (".ninja_log", ".ninja_deps", "build.ninja"):
            shutil.copy2(f, into / f.name)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_a_machine_without_the_build_runs_torch_and_builds_it_in_the_background(tmp_path, monkeypatch):
    """What a first server start does: no build -> None (the torch paths) and one background build, which
    the next start (a new process) then loads. The cache folder has no extension module, only the compiled
    objects of this session's own build (tests/kernels compiles it anyway, and its compile is what the other
    kernel tests check): the background process runs the same cpp_extension.load and only links, ~5 s
    instead of a second ~20-40 s compile. The next start runs in a process of its own, as it would for real:
    this one loaded the kernels from the default cache already, and torch recompiles (as a "_v1" module) an
    extension that one process loads from a second folder, another ~20-40 s that tested nothing."""
    _objects_without_the_module(cpu_ext.build_dir(), tmp_path)
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
        modules = sorted(f.name for f in fresh.build_dir().glob("*.so"))
        assert modules == [f"{fresh._name(fresh.build_dir())}.so"]
        next_start = subprocess.run([sys.executable, "-c", NEXT_START], cwd=ROOT, capture_output=True, text=True,
                                    timeout=280)
        assert next_start.returncode == 0, next_start.stderr[-3000:]
        assert next_start.stdout.split() == ["loaded", str(fresh.build_dir())]
        assert sorted(f.name for f in fresh.build_dir().glob("*.so")) == modules  # loaded, not rebuilt
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


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_the_workers_found_the_kernels_built():
    """Under pytest-xdist (the default run) tests/conftest.py builds the kernels in the controller before
    any worker starts. The engine tests that load them (tests/serve, tests/train) skip without a build, and
    a worker may reach them before any kernel test here has built anything: without that build they would
    skip unseen. The controller's result is checked, not this process's (a kernel test that ran before this
    one on this worker has built them anyway)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("one process: tests/kernels runs first and builds the kernels there")
    assert os.environ.get("COMPOSER_TEST_KERNELS") == "built"
    assert cpu_ext.load(build_in_background=False) is not None
