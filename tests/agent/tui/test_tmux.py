"""Smoke test in a real terminal: `composer-agent` inside tmux, driven with send-keys, read with
capture-pane. Catches what a headless driver cannot: the real terminal driver, key decoding, start-up
through the CLI. Skipped where tmux is not installed."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agent.scripted import ScriptedServer

ROOT = Path(__file__).resolve().parents[3]
TMUX = shutil.which("tmux")
pytestmark = [pytest.mark.skipif(TMUX is None, reason="tmux is not installed"), pytest.mark.slow]


class Tmux:
    def __init__(self) -> None:
        self.socket = f"composer-test-{uuid.uuid4().hex[:8]}"  # a private server: never the user's

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True, timeout=10)

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "ui").stdout

    def wait_for(self, text: str, timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.05)
        raise AssertionError(f"{text!r} never appeared; the pane shows:\n{self.screen()}")

    def alive(self) -> bool:
        return self("has-session", "-t", "ui").returncode == 0


def test_the_tui_in_a_real_terminal(git_repo):
    (git_repo / "hello.txt").write_text("hello\n")
    script = [
        {"content": "Looking.", "tool_calls": [{"name": "shell", "arguments": {"command": "cat hello.txt"}},
                                               {"name": "read_file", "arguments": {"path": "hello.txt"}}]},
        {"content": "The file says **hello**."},
    ]
    tmux = Tmux()
    with ScriptedServer(script) as srv:
        command = shlex.join(["env", f"PYTHONPATH={ROOT}", f"XDG_CONFIG_HOME={git_repo.parent / 'xdg'}",
                              sys.executable, "-m", "agent.cli", "--cwd", str(git_repo), "--base-url", srv.base_url,
                              "--approval", "auto"])
        command += "; echo '[exited]'; sleep 30"  # the pane stays, to show what was printed on the way out
        try:
            assert tmux("new-session", "-d", "-s", "ui", "-x", "110", "-y", "32", command).returncode == 0
            tmux.wait_for("Ask Composer")
            tmux.wait_for("scripted-model")  # connected
            tmux("send-keys", "-t", "ui", "-l", "what does hello.txt say?")
            tmux("send-keys", "-t", "ui", "Enter")
            screen = tmux.wait_for("The file says hello.")
            assert "✓ shell  cat hello.txt  exit 0" in screen
            assert "✓ read_file  hello.txt  lines 1–1 of 1" in screen
            assert "what does hello.txt say?" in screen
            tmux("send-keys", "-t", "ui", "C-d")
            screen = tmux.wait_for("[exited]", timeout=10)
            (session,) = (git_repo / ".composer" / "sessions").glob("*.jsonl")
            assert f"composer-agent --cwd {git_repo} --resume {session.stem}" in screen.replace("\n", "")
        finally:
            tmux("kill-server")
