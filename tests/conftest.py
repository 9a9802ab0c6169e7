"""Shared fixtures: real temporary workspaces and real git repositories."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Servers the tests start never compile our CPU kernels in the background (kernels/cpu_ext.py): a 30-60 s
# build competing with timing-sensitive tests makes them flaky. The test run builds them once, in the open
# (pytest_configure below; in one process, tests/kernels, which runs first), and the engine tests load it.
os.environ.setdefault("COMPOSER_KERNEL_BUILD", "0")


# The pytest runs the tests start (task verify commands, the scripted expert's test runs, in task workspaces)
# load no setuptools plugins: this venv's (schemathesis, hypothesis, anyio, ...) cost ~1-3 s per start-up,
# re-parsed every time since workspaces write no bytecode, and no task's tests use them. The scripted
# expert's 8 synthetic-small tasks: 32 s -> 10 s on the loaded 2-core VM. This run's own plugins are loaded
# already. train/recipe.py and agent/demo.py set the same for their verify runs.
USERS_AUTOLOAD = os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
os.environ.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def workers(cores: int) -> int:
    """How many pytest-xdist workers `-n auto` (pyproject's addopts) starts: one a core, at most 4. Most
    tests wait on one core (a tiny model, a server they started, git, a subprocess): on the 2-core VM two
    workers ran the suite in about half the time of one process."""
    return max(1, min(4, cores))


def torch_threads(cores: int, worker_count: int) -> int:
    """Half the cores a worker has (at most 4, at least 1)."""
    return max(1, min(4, cores // (2 * max(1, worker_count))))


# Torch threads: half the cores of this worker's share (1 on 2 cores, at most 4) unless OMP_NUM_THREADS says
# otherwise; the servers the tests start inherit it. Torch takes every core by default, and its pool's threads spin at
# each barrier waiting for the others: when they outnumber the free cores (a server a test started,
# another test run, anything else on the machine) the spin costs far more than the threads give these
# tiny models. On the shared 2-core VM, tests/train/test_trainer.py (not slow) took 19-21 s on 1 thread,
# and on 2 threads 25 s at a quiet moment and 129 s beside another engineer's run.
USERS_THREADS = os.environ.get("OMP_NUM_THREADS")  # the user's choice stands
os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads(cores(), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))
if "torch" in sys.modules:  # loaded already (by a plugin): the variable came too late for its pool
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A test run started in the background by a shell without job control (`pytest &`, nohup) inherits
# SIGINT ignored, and every process it starts would too: the Ctrl-C tests would then test nothing
# but that. The children get the default disposition back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_xdist_auto_num_workers(config) -> int:
    return workers(cores())


@pytest.hookimpl(trylast=True)  # after the terminal reporter is set up: the build's line shows as it starts
def pytest_configure(config):
    """Under pytest-xdist the controller builds our C++ CPU kernels (kernels/cpu_ext.py) once, before any
    worker starts: the engine tests load that build and skip without it, and with the tests spread over
    workers nothing orders tests/kernels (which builds it) before them. Without a C++ compiler the build
    fails here and those tests skip, as before."""
    if getattr(config, "workerinput", None) is not None or not getattr(config.option, "numprocesses", None):
        return
    if USERS_AUTOLOAD is None:  # the workers it starts are pytest runs that need their plugins (xdist's own)
        os.environ.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    if config.option.collectonly:
        return
    say = getattr(config.pluginmanager.get_plugin("terminalreporter"), "write_line", lambda line: None)
    say("tests/conftest.py: building our C++ CPU kernels before the workers start "
        "(about a minute the first time on a machine) ...")
    started = time.monotonic()
    try:
        built = subprocess.run([sys.executable, "-m", "kernels.cpu_ext", "--quiet"], cwd=ROOT,
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=600).returncode == 0
    except subprocess.TimeoutExpired:
        built = False
    os.environ["COMPOSER_TEST_KERNELS"] = "built" if built else "not built"  # the workers inherit it
    say(f"CPU kernels {'ready' if built else 'not built (the tests that need them skip)'} "
        f"in {time.monotonic() - started:.0f} s")


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
