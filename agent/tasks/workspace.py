"""Isolated workspaces: a fresh copy of the task's folder per episode, verified, then removed.

Many episodes run at once without interfering: each gets its own temporary folder. The verify
command runs after the episode in that folder, in its own process group, killed with its children at
the timeout.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agent.tasks.spec import Task


@dataclass
class Workspace:
    root: Path

    @classmethod
    def create(cls, task: Task, parent: str | Path | None = None) -> Workspace:
        tmp = Path(tempfile.mkdtemp(prefix=f"composer-{_safe(task.id)}-", dir=parent))
        root = tmp / "repo"
        shutil.copytree(task.workspace, root, symlinks=True)
        return cls(root)

    def cleanup(self) -> None:
        shutil.rmtree(self.root.parent, ignore_errors=True)


def verify(task: Task, root: Path) -> tuple[bool, str]:
    """(passed, the tail of the verify command's output)."""
    try:
        proc = subprocess.Popen(["bash", "-c", task.verify], cwd=root, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    except OSError as e:
        return False, f"verify could not start: {e}"
    try:
        out, _ = proc.communicate(timeout=task.verify_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return False, f"verify timed out after {task.verify_timeout_s} s\n{out[-2000:]}"
    return proc.returncode == 0, out[-2000:]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40]
