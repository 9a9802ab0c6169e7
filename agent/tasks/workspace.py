"""Isolated workspaces: a private copy of the task's source per episode, verified, then removed.

Each episode gets its own temporary folder (a copy of a folder, a `git clone --shared` checked out at
the task's commit, or files written by a generator), so many episodes run at once without touching
each other or the source. Only after the episode are the hidden verification files put in place and
the verify command run, in its own process group, killed with its children at the timeout. The
agent's final answer is written beside the workspace (not in it) and named by $COMPOSER_ANSWER_FILE.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agent.tasks.spec import Task, TaskError
from agent.tasks.variation import Variation

GIT_IDENT = ("-c", "user.name=composer", "-c", "user.email=composer@localhost")


def init_repo(root: Path, branch: str, message: str = "start") -> None:
    """Make `root` a git repository on `branch` with everything in one commit (TaskError if git fails).
    The branch comes as init.defaultBranch, which git versions without `init -b` accept too."""
    _git(root, *GIT_IDENT, "-c", f"init.defaultBranch={branch}", "init", "-q")
    _git(root, *GIT_IDENT, "add", "-A")
    _git(root, *GIT_IDENT, "commit", "-qm", message)


@dataclass
class Workspace:
    root: Path
    task: Task
    home: Path | None = None  # the temporary folder holding it, removed by cleanup (default: root's parent)

    def __post_init__(self) -> None:
        self.home = self.home or self.root.parent

    @classmethod
    def create(cls, task: Task, parent: str | Path | None = None, variation: Variation | None = None) -> Workspace:
        """A fresh copy in a new temporary folder: TMP/repo, or with a `variation` (training data, see
        agent/tasks/variation.py) TMP/<dirs>/<name>, a git repository on its branch if it names one."""
        prefix = variation.prefix if variation else f"composer-{_safe(task.id)}-"
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        root = tmp.joinpath(*variation.dirs, variation.name) if variation else tmp / "repo"
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
            if task.workspace:
                shutil.copytree(task.workspace, root, symlinks=True)
            elif task.repo:
                _git(tmp, "clone", "-q", "--shared", "--no-checkout", task.repo, str(root))
                _git(root, "checkout", "-q", "--detach", task.commit or "HEAD")
            else:
                from agent.tasks.families import materialize

                root.mkdir()
                materialize(task, root, hidden=False)
            if variation and variation.branch and not task.repo and shutil.which("git"):
                init_repo(root, variation.branch)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cls(root, task, tmp)

    def install_hidden(self) -> None:
        """Put the verification files in place (after the episode, never before)."""
        t = self.task
        if t.hidden:
            shutil.copytree(t.hidden, self.root, dirs_exist_ok=True)
        if t.generator:
            from agent.tasks.families import materialize

            materialize(t, self.root, hidden=True)
        if t.hidden_patch:
            p = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=self.root, input=t.hidden_patch,
                               text=True, capture_output=True)
            if p.returncode != 0:
                raise TaskError(f"task {t.id}: the hidden patch does not apply: {p.stderr.strip()[:300]}")

    def verify(self, answer: str = "") -> tuple[bool, str]:
        """Install the hidden files, run the verify command: (passed, the tail of its output)."""
        answer_file = self.home / "answer.txt"
        answer_file.write_text(answer, encoding="utf-8")
        try:
            self.install_hidden()
        except (OSError, TaskError) as e:
            return False, f"verification could not be set up: {e}"
        return run_verify(self.task.verify, self.root, self.task.verify_timeout_s,
                          {"COMPOSER_ANSWER_FILE": str(answer_file)})

    def cleanup(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


def run_verify(command: str, cwd: Path, timeout_s: float, extra_env: dict[str, str] | None = None) -> tuple[bool, str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(extra_env or {})}
    env.pop("TRITON_INTERPRET", None)
    try:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True, env=env)
    except OSError as e:
        return False, f"verify could not start: {e}"
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return False, f"verify timed out after {timeout_s} s\n{out[-2000:]}"
    return proc.returncode == 0, out[-2000:]


def _git(cwd: Path, *args: str) -> None:
    p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise TaskError(f"git {' '.join(args[:2])} failed: {p.stderr.strip()[:300]}")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40]
