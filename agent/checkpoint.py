"""Checkpoints for /undo: a snapshot of the workspace before each turn, outside the user's git history.

Snapshots live in a git repository of our own under `.composer/checkpoints` (its own GIT_DIR and
index; the workspace is only its work tree), so the user's commits, index, stash and hooks are never
touched. Everything git would see is snapshotted: files changed by edit tools and by shell commands
alike; files the user's .gitignore ignores are not. It works outside git repositories too.

Limits: ignored files (build outputs, .env) are not restored; very large repositories pay for
hashing their files at the first snapshot (git's stat cache makes later ones cheap).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from agent.tools.context import STATE_DIR, Workspace

GIT_CONFIG = ["-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null", "-c", "core.autocrlf=false",
              "-c", "user.name=composer", "-c", "user.email=composer@localhost", "-c", "gc.auto=0"]


class CheckpointError(RuntimeError):
    pass


@dataclass
class Checkpoints:
    root: Path
    stack: list[tuple[str, str]] = field(default_factory=list)  # (commit, label), oldest first
    undone: int = 0  # turns undone since the last snapshot

    @property
    def git_dir(self) -> Path:
        return self.root / STATE_DIR / "checkpoints"

    def _git(self, *args: str, check: bool = True) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        env |= {"GIT_DIR": str(self.git_dir), "GIT_WORK_TREE": str(self.root), "GIT_TERMINAL_PROMPT": "0"}
        proc = subprocess.run(["git", *GIT_CONFIG, *args], cwd=self.root, env=env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise CheckpointError(f"git {args[0]} failed: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc.stdout

    def _init(self) -> None:
        if (self.git_dir / "HEAD").exists():
            return
        Workspace(self.root).state_dir("checkpoints")  # .composer/ comes with its .gitignore
        self._git("init", "-q")
        (self.git_dir / "info").mkdir(exist_ok=True)
        (self.git_dir / "info" / "exclude").write_text(f"/{STATE_DIR}/\n")

    def snapshot(self, label: str) -> str:
        """Record the workspace as it is now; returns the snapshot's commit id."""
        self._init()
        self._git("add", "-A", "--", ".")
        self._git("commit", "-q", "--allow-empty", "--no-verify", "-m", label)
        commit = self._git("rev-parse", "HEAD").strip()
        self.stack.append((commit, label))
        self.undone = 0
        return commit

    def undo(self) -> list[str]:
        """Put back every file as it was at the last snapshot; returns the paths that changed."""
        if not self.stack:
            if self.undone:
                turns = "the last turn's" if self.undone == 1 else f"all {self.undone} turns'"
                raise CheckpointError(f"nothing more to undo: {turns} file changes are already undone")
            raise CheckpointError("nothing to undo: no turn has run since the session started")
        commit, _ = self.stack.pop()
        self.undone += 1
        self._git("add", "-A", "--", ".")
        changes = self._git("diff", "--cached", "--name-status", "--no-renames", "-z", commit)
        fields = changes.split("\0")
        restore, delete = [], []
        for status, path in zip(fields[0::2], fields[1::2], strict=False):
            if status == "A":
                delete.append(path)
            elif status:
                restore.append(path)
        if restore:
            self._git("checkout", commit, "--", *restore)
        for path in delete:
            target = self.root / path
            try:
                target.unlink()
            except FileNotFoundError:
                pass
            _prune_empty_dirs(target.parent, self.root)
        self._git("reset", "-q", "--soft", commit)
        self._git("add", "-A", "--", ".")
        return sorted(restore + delete)


def _prune_empty_dirs(folder: Path, root: Path) -> None:
    while folder != root and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
