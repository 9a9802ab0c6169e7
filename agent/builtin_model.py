"""The built-in model: with no endpoint configured, `composer-agent` serves the small checkpoint that
ships in the package (serve/builtin/composer-tiny) as a child `composer-serve` on a free loopback port.

The agent imports no torch, so the model runs in another process: `python -m serve.cli --port 0`,
whose ready line names the port it bound; `/health` then says when it answers. The child gets its
own session, so a Ctrl-C in the terminal interrupts the agent's turn and not the server; we stop it
(SIGTERM to its process group, SIGKILL after a grace period) when the agent exits, raises or is
interrupted. If the agent dies without cleaning up (SIGKILL, os._exit), the kernel sends the child
SIGTERM (PR_SET_PDEATHSIG, Linux), and a pipe on its stdin that closes with us does the same
elsewhere (composer-serve watches it when COMPOSER_SERVE_STDIN_WATCHDOG is set).

The checkpoint is found without importing `serve` (importlib.util.find_spec only locates it).
COMPOSER_BUILTIN_MODEL overrides its folder (tests, packagers).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

BUILTIN_NAME = "composer-tiny"
ENV_DIR = "COMPOSER_BUILTIN_MODEL"
SERVE_MODULES = ("torch", "transformers", "safetensors", "tokenizers", "fastapi", "uvicorn", "jinja2")
READY = re.compile(r"serving .* at (http://\S+/v1)")
NOTICE = (
    f"composer-agent: no model server configured, so using the small built-in model ({BUILTIN_NAME}, "
    "CPU; it knows only small synthetic tasks: fixing an injected bug, finding a definition); point it at a real one with "
    "--base-url URL, "
    "COMPOSER_BASE_URL or base_url in .composer/config.toml"
)
PR_SET_PDEATHSIG = 1
BUILTIN_MAX_TOKENS = 96  # per turn, as in its evaluation (its turns are a few dozen tokens)


class BuiltinModelError(Exception):
    """The built-in model cannot be started (reported in one line, exit 2)."""


def builtin_model_dir() -> Path:
    """The shipped checkpoint's folder (it may not exist: check before use)."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    spec = importlib.util.find_spec("serve")
    if spec is None or not spec.submodule_search_locations:
        raise BuiltinModelError("the `serve` package is not installed: pip install -e '.[serve]'")
    return Path(list(spec.submodule_search_locations)[0]) / "builtin" / BUILTIN_NAME


def missing_serve_packages() -> list[str]:
    """The serve extra's packages that cannot be found (located only: importing torch here takes seconds)."""
    missing = []
    for name in SERVE_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):  # a finder refused it, or a half-removed package
            missing.append(name)
    return missing


@dataclass
class LocalServer:
    """A composer-serve child; `stop()` is idempotent."""

    proc: subprocess.Popen
    base_url: str = ""
    log_path: Path | None = None
    _stdout: list[str] = field(default_factory=list)

    def configure(self, config) -> None:
        """Point `config` at this server, greedy and with short answers unless configured otherwise:
        the tiny model is evaluated that way (temperature 0, 96 tokens a turn)."""
        config.base_url = self.base_url
        config.builtin_model = True
        if config.temperature is None:
            config.temperature = 0.0
        if config.max_output_tokens is None:
            config.max_output_tokens = BUILTIN_MAX_TOKENS

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            text = ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_parent():
    """A preexec_fn: SIGTERM when the parent dies (Linux); None where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def launch(
    model_dir: Path, *, served_name: str = BUILTIN_NAME, extra_args: tuple[str, ...] = ()
) -> LocalServer:
    """Start the child (not yet ready: see `wait_ready`)."""
    fd, log = tempfile.mkstemp(prefix="composer-serve-", suffix=".log")
    cmd = [
        sys.executable,
        "-m",
        "serve.cli",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *extra_args,
    ]
    # The built-in model's server never starts the CPU kernels' one-time build in the background (a minute
    # of a core, during the user's first session); it uses a build the test suite or `python -m
    # kernels.cpu_ext` made (its float64 kernels: ~1.4x the torch paths' decode, BENCHMARKS.md).
    env = {**os.environ, "COMPOSER_SERVE_STDIN_WATCHDOG": "1", "PYTHONUNBUFFERED": "1",
           "COMPOSER_KERNEL_BUILD": os.environ.get("COMPOSER_KERNEL_BUILD", "0")}
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=fd,
            text=True,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
            env=env,
        )
    finally:
        os.close(fd)
    server = LocalServer(proc, log_path=Path(log))
    # Drain stdout for the server's life so it can never block on a full pipe.
    threading.Thread(
        target=_read_lines, args=(proc.stdout, server._stdout), name="serve-stdout", daemon=True
    ).start()
    return server


def _read_lines(stream: TextIO, out: list[str]) -> None:
    with contextlib.suppress(OSError, ValueError):
        for line in stream:
            out.append(line)


def wait_ready(server: LocalServer, *, timeout_s: float = 600.0, status: TextIO | None = None) -> str:
    """Wait for the ready line and a 200 from /health; show a live line on a terminal after 1 s."""
    start = time.monotonic()
    live = status is not None and status.isatty()
    shown = False
    try:
        while True:
            if not server.base_url:
                for line in list(server._stdout):
                    m = READY.search(line)
                    if m:
                        server.base_url = m.group(1)
            if server.base_url and _healthy(server.base_url):
                return server.base_url
            if not server.alive():
                tail = server.log_tail()
                raise BuiltinModelError(
                    f"the built-in model server exited with code {server.proc.returncode}"
                    + (f":\n{tail}" if tail else "")
                )
            elapsed = time.monotonic() - start
            if elapsed > timeout_s:
                raise BuiltinModelError(f"the built-in model server was not ready after {timeout_s:.0f} s")
            if live and elapsed > 1.0:
                status.write(f"\r\033[Kcomposer-agent: loading the built-in model... {elapsed:.0f} s")
                status.flush()
                shown = True
            time.sleep(0.1)
    finally:
        if shown:
            status.write("\r\033[K")
            status.flush()


def _healthy(base_url: str) -> bool:
    url = base_url.removesuffix("/v1") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_builtin(*, out: TextIO | None = None, timeout_s: float = 600.0, notice: bool = True) -> LocalServer:
    """Print the notice, start composer-serve on the built-in checkpoint and wait until it answers.
    The caller must `stop()` it (on every path: use try/finally or `with`). `notice=False` for the
    interactive front-ends: their session opens with the same news (render.BUILTIN_BANNER), and twice in
    a row reads like two problems."""
    out = sys.stderr if out is None else out
    missing = missing_serve_packages()
    if missing:
        raise BuiltinModelError(
            f"the built-in model needs the `serve` extra ({', '.join(missing)} not installed): "
            "pip install -e '.[serve]', or point composer-agent at a server with --base-url"
        )
    model_dir = builtin_model_dir()
    if not (model_dir / "config.json").is_file():
        raise BuiltinModelError(
            f"the built-in model is not installed at {model_dir}; "
            "point composer-agent at a server with --base-url URL"
        )
    if notice:
        print(NOTICE, file=out, flush=True)
    server = launch(model_dir)
    try:
        wait_ready(server, timeout_s=timeout_s, status=out)
    except BaseException:  # Ctrl-C or a failure while loading: never leave the child behind
        server.stop()
        raise
    return server
