"""The inference server a run samples from: a `composer-serve` we launch, or one given by URL.

Weight sync is the server's own authenticated `POST /v1/load_weights {"path", "policy_version"}`:
the checkpoint folder the trainer just wrote is loaded in place; requests in flight finish on the old
weights and every completion reports the version that produced it.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx


class ServerError(RuntimeError):
    pass


@dataclass
class Server:
    base_url: str
    model: str
    api_key: str | None
    proc: subprocess.Popen | None = None

    def load_weights(self, path: str | Path, version: int, timeout: float = 600.0) -> float:
        """Serve the checkpoint at `path` as `version`; returns the seconds it took."""
        t0 = time.monotonic()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        r = httpx.post(f"{self.base_url}/load_weights", json={"path": str(Path(path).resolve()),
                                                              "policy_version": version},
                       headers=headers, timeout=timeout)
        if r.status_code != 200:
            raise ServerError(f"{self.base_url}/load_weights answered HTTP {r.status_code}: {r.text[:300]}")
        got = r.json().get("policy_version")
        if got != version:
            raise ServerError(f"the server reports policy version {got} after loading version {version}")
        return time.monotonic() - t0

    def version(self) -> int | None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        r = httpx.get(f"{self.base_url}/models", headers=headers, timeout=30)
        cards = r.json().get("data") or [{}]
        return cards[0].get("policy_version")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def cpu_share() -> int | None:
    """Torch threads for each side when a run's sampler and trainer work at the same time (async RL,
    max_staleness > 0) on this machine's CPU cores: half the cores each (at least 1). Two OpenMP pools
    that each take every core spin against each other: on 2 cores an RL step of the tiny recipe took 60 s
    to train and 120 s to roll out, against 10 s and 45 s split 1 + 1 (BENCHMARKS, "Sharing the CPU").
    When they take turns (synchronous RL) each is faster with every core. None (leave torch's choice)
    with a GPU, or when OMP_NUM_THREADS is set: the user's choice stands."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // 2)


def is_loopback(url: str) -> bool:
    """Whether `url` names this machine (its server shares our cores)."""
    host = urlparse(url).hostname or ""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def launch(model_dir: str | Path, *extra: str, name: str = "policy", timeout: float = 300.0,
           log_path: Path | None = None, threads: int | None = None) -> Server:
    """Start `composer-serve` on a free loopback port with a fresh API key; wait until it answers. With
    `threads` its torch uses that many (cpu_share() when it will run beside a trainer on CPU)."""
    key = "sk-train-" + secrets.token_hex(12)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "serve.cli", "--model", str(model_dir), "--port", "0", "--served-model-name", name,
           "--api-key", key, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log = open(log_path, "a") if log_path else None  # noqa: SIM115 - lives as long as the server
    lines: list[str] = []
    base = None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if log:
            log.write(line)
        if m := re.search(r"serving .* at (http://\S+/v1)", line):
            base = m.group(1)
            break
        if time.monotonic() > deadline:
            break
    if base is None:
        proc.kill()
        raise ServerError("composer-serve did not start:\n" + "".join(lines[-20:]))

    def drain() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if log:
                log.write(line)
                log.flush()

    threading.Thread(target=drain, daemon=True).start()
    while time.monotonic() < deadline:
        try:
            if httpx.get(base.removesuffix("/v1") + "/health", timeout=2).status_code == 200:
                return Server(base, name, key, proc)
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise ServerError("composer-serve never became healthy")
