"""A composer-serve we launch shares the CPU with the trainer and the rollouts: on CPU it takes half the
cores (OMP_NUM_THREADS in its environment), unless the user chose a thread count."""

from __future__ import annotations

import os
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
def test_launched_server_gets_its_share_of_threads(tiny, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = cpu_share()
    server = launch(tiny, "--dtype", "float32")
    try:
        got = _child_env(server.proc.pid).get("OMP_NUM_THREADS")
        assert got == (str(share) if share else None)
    finally:
        server.stop()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's setting reaches the child unchanged
    server = launch(tiny, "--dtype", "float32", threads=None)
    try:
        assert _child_env(server.proc.pid)["OMP_NUM_THREADS"] == "1"
    finally:
        server.stop()
