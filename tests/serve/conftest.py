"""Tiny random Qwen3-MoE checkpoints (built once per session) and a running composer-serve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from serve.tiny import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_hermes(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-hermes", template="hermes")


@pytest.fixture(scope="session")
def tiny_coder(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-coder", template="qwen3_coder", seed=1)


class Server:
    def __init__(self, proc: subprocess.Popen, base_url: str):
        self.proc, self.base_url = proc, base_url

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_server(model: Path, *args: str, timeout: float = 120) -> Server:
    """Run `composer-serve` as a subprocess on a free port; wait until /health answers."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "--model", str(model), "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"serving .* at (http://\S+/v1)", line)
        if m:
            base = m.group(1)
            break
        if time.monotonic() > deadline:
            break
    else:
        raise RuntimeError("composer-serve exited:\n" + "".join(lines))
    # keep the pipe drained, and what it said (the log) for tests that read it
    threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True).start()
    while time.monotonic() < deadline:
        try:
            if httpx.get(base.removesuffix("/v1") + "/health", timeout=1).status_code == 200:
                srv = Server(proc, base)
                srv.lines = lines
                return srv
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("composer-serve never became healthy:\n" + "".join(lines))


@pytest.fixture(scope="session", params=["native", "hf"])
def hermes_server(request, tiny_hermes):
    """composer-serve on the tiny checkpoint, once per engine: the API behaves the same on both."""
    srv = start_server(tiny_hermes, "--served-model-name", "tiny", "--api-key", "sk-test", "--engine", request.param,
                       "--dtype", "float32")
    srv.engine = request.param
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def plain_server(tiny_hermes):
    """composer-serve (native engine, no key) on the tiny hermes checkpoint, for API tests that only read
    their own answers: test_responses_api.py and test_forced_calls.py's hermes case share it (a start is
    ~5 s on 2 cores)."""
    srv = start_server(tiny_hermes, "--served-model-name", "tiny", "--dtype", "float32")
    yield srv
    srv.stop()


KEY = "sk-test"


@pytest.fixture(scope="session")
def native_server(tiny_hermes):
    """composer-serve (native engine, key sk-test) for the reliability tests: faults, disconnects, limits."""
    srv = start_server(tiny_hermes, "--served-model-name", "tiny", "--api-key", KEY, "--dtype", "float32")
    yield srv
    srv.stop()


def gauge(server: Server, name: str) -> float:
    """A gauge's value from /metrics (composer_requests_running, composer_kv_cache_usage_ratio, ...)."""
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def wait_idle(server: Server, timeout: float = 15) -> bool:
    """Whether the engine is back to no running or waiting sequence and an empty KV cache in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(gauge(server, g) for g in ("composer_requests_running", "composer_requests_waiting",
                                              "composer_kv_cache_usage_ratio")):
            return True
        time.sleep(0.1)
    return False
