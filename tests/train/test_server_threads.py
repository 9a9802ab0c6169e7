"""Async RL on CPU: the composer-serve we launch and the trainer take half the cores each
(OMP_NUM_THREADS in the child's environment, torch.set_num_threads here), unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train.server import cpu_share, is_loopback, launch


def _child_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def test_cpu_share_is_half_the_cores_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if torch.cuda.is_available():
        assert cpu_share() is None
        return
    cores = len(os.sched_getaffinity(0))
    assert cpu_share() == max(1, cores // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_share() is None


def test_loopback_urls():
    assert is_loopback("http://127.0.0.1:8000/v1") and is_loopback("http://localhost:1/v1")
    assert is_loopback("http://[::1]:8000/v1")
    assert not is_loopback("http://10.0.0.7:8000/v1") and not is_loopback("https://api.example.com/v1")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads the child's environment from /proc")
def test_launch_passes_threads_and_keeps_the_users_setting(tiny, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    server = launch(tiny, "--dtype", "float32", threads=1)
    try:
        assert _child_env(server.proc.pid).get("OMP_NUM_THREADS") == "1"
    finally:
        server.stop()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # no threads given: the user's setting reaches the child
    server = launch(tiny, "--dtype", "float32")
    try:
        assert _child_env(server.proc.pid)["OMP_NUM_THREADS"] == "2"
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_async_rl_splits_the_cores_and_sync_rl_does_not(tiny, tmp_path, monkeypatch, staleness):
    from train.progress import Progress
    from train.rl import RLConfig, run
    from train.trainer import TrainerConfig

    from .test_rl import suite

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share, before = cpu_share(), torch.get_num_threads()
    cfg = RLConfig(steps=1, group_size=2, groups_per_step=1, workers=2, max_staleness=staleness,
                   max_output_tokens=8)
    run(tiny, suite(tmp_path), tmp_path / "run", cfg, trainer_cfg=TrainerConfig(lr=1e-3),
        progress=Progress(1, out=open(os.devnull, "w")))  # noqa: SIM115
    assert torch.get_num_threads() == before  # the trainer's threads are given back
    line = (tmp_path / "run" / "server.log").read_text().splitlines()[0]
    threads = share if staleness and share else _torch_default()  # without a share: torch's own choice
    assert f"cpu ({threads} thread" in line, line


def _torch_default() -> int:
    """Torch's thread count where nothing sets one (tests/conftest.py sets one for this process)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    p = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                       capture_output=True, text=True, timeout=120)
    return int(p.stdout)
