"""The test run's torch, and the servers it starts, use at most half the cores (tests/conftest.py): a
pool that takes every core spins against whatever else runs, and made the suite 4x slower under load."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import USERS_THREADS, cores, torch_threads


def test_torch_here_and_in_children_runs_on_at_most_half_the_cores():
    import torch

    worker_count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    want = int(USERS_THREADS) if USERS_THREADS else torch_threads(cores(), worker_count)
    assert torch.get_num_threads() == want
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, timeout=120)
    assert int(child.stdout) == want, child.stderr
