"""Shared fixtures: real temporary workspaces and real git repositories."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# Servers the tests start never compile our CPU kernels in the background (kernels/cpu_ext.py): a 30-60 s
# build competing with timing-sensitive tests makes them flaky. tests/kernels builds them once, in the
# open, and the engine tests that run after it load that build.
os.environ.setdefault("COMPOSER_KERNEL_BUILD", "0")


# The pytest runs the tests start (task verify commands, the scripted expert's test runs, in task workspaces)
# load no setuptools plugins: this venv's (schemathesis, hypothesis, anyio, ...) cost ~1-3 s per start-up,
# re-parsed every time since workspaces write no bytecode, and no task's tests use them. The scripted
# expert's 8 synthetic-small tasks: 32 s -> 10 s on the loaded 2-core VM. This run's own plugins are loaded
# already. train/recipe.py and agent/demo.py set the same for their verify runs.
os.environ.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def _torch_threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores // 2))


# Torch threads: half the cores (1 on 2 cores, at most 4) unless OMP_NUM_THREADS says otherwise; the
# servers the tests start inherit it. Torch takes every core by default, and its pool's threads spin at
# each barrier waiting for the others: when they outnumber the free cores (a server a test started,
# another test run, anything else on the machine) the spin costs far more than the threads give these
# tiny models. On the shared 2-core VM, tests/train/test_trainer.py (not slow) took 19-21 s on 1 thread,
# and on 2 threads 25 s at a quiet moment and 129 s beside another engineer's run.
USERS_THREADS = os.environ.get("OMP_NUM_THREADS")  # the user's choice stands
os.environ.setdefault("OMP_NUM_THREADS", str(_torch_threads()))
if "torch" in sys.modules:  # loaded already (by a plugin): the variable came too late for its pool
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A test run started in the background by a shell without job control (`pytest &`, nohup) inherits
# SIGINT ignored, and every process it starts would too: the Ctrl-C tests would then test nothing
# but that. The children get the default disposition back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def git_repo(tmp_path: Path) -> Path:
    """An empty git repository with an identity configured."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "test@example.com")
    git(repo, "config", "user.name", "Test")
    return repo
