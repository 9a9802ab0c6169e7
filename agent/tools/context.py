"""The workspace a tool works in, and the per-session state tools share.

Every path a model gives is resolved against the workspace root, symlinks followed; whatever lands
outside the root (and outside any root the user added explicitly) is refused. `.git/` internals are
never written.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.tools.base import ToolError

STATE_DIR = ".composer"


@dataclass
class Workspace:
    """The folder the agent may touch. `extra_roots` are folders the user added explicitly."""

    root: Path
    extra_roots: tuple[Path, ...] = ()
    _temps_cleared: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.root = Path(os.path.realpath(self.root))
        self.extra_roots = tuple(Path(os.path.realpath(r)) for r in self.extra_roots)
        if not self.root.is_dir():
            raise NotADirectoryError(f"workspace root is not a directory: {self.root}")

    def resolve(self, path: str, *, for_write: bool = False) -> Path:
        """Resolve a model-supplied path; raise ToolError when it escapes the workspace."""
        if not isinstance(path, str) or not path.strip():
            raise ToolError("path is empty")
        if "\x00" in path:
            raise ToolError("path contains a NUL byte")
        p = Path(os.path.expanduser(path.strip()))
        if not p.is_absolute():
            p = self.root / p
        real = Path(os.path.realpath(p))
        root = self._root_of(real)
        if root is None:
            shown = path if path == str(real) else f"{path} (resolves to {real})"
            raise ToolError(
                f"{shown} is outside the workspace {self.root}; only paths inside it can be used"
            )
        if for_write and ".git" in real.relative_to(root).parts:
            raise ToolError(f"{path} is inside .git/; git internals are never written by tools")
        return real

    def _root_of(self, real: Path) -> Path | None:
        for r in (self.root, *self.extra_roots):
            if real == r or r in real.parents:
                return r
        return None

    def display(self, real: Path) -> str:
        """How a resolved path is shown to the model: relative to the root when inside it."""
        try:
            rel = real.relative_to(self.root)
        except ValueError:
            return str(real)
        return rel.as_posix() or "."

    def state_dir(self, *sub: str) -> Path:
        """`.composer/` (or a folder under it), created on demand and kept out of git."""
        base = self.root / STATE_DIR
        if not base.exists():
            base.mkdir(parents=True, exist_ok=True)
            (base / ".gitignore").write_text(
                "# Composer's state (sessions, index, logs) stays out of git; config.toml may be shared.\n"
                "*\n!config.toml\n"
            )
        d = base.joinpath(*sub)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def temp_dir(self) -> Path:
        """`.composer/tmp/`, where writes stage their temp files; the first call clears the temp files
        of writes that were killed mid-way (their process is gone)."""
        from agent.tools.fileio import remove_stale_temps

        d = self.state_dir("tmp")
        if not self._temps_cleared:
            self._temps_cleared = True
            remove_stale_temps(d)
        return d


def find_ripgrep() -> str | None:
    """`rg` from this environment's bin (the `ripgrep` wheel) first, then PATH."""
    if os.environ.get("COMPOSER_NO_RIPGREP"):
        return None
    local = Path(sys.executable).parent / "rg"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("rg")


@dataclass
class ToolContext:
    """What tools share during one session.

    `cancel` is set to interrupt running tools (shell kills its process group).
    `use_ripgrep=False` forces the pure-Python search fallback.
    """

    workspace: Workspace
    sandbox: bool = False
    use_ripgrep: bool = True
    cancel: threading.Event = field(default_factory=threading.Event)
    todos: list[dict[str, Any]] = field(default_factory=list)
    # Extra linters from the user's config: glob -> command ("{paths}" is replaced by the files).
    linters: dict[str, str] = field(default_factory=dict)
    # The editor's view of files when a front-end has one (ACP's fs/read_text_file, fs/write_text_file),
    # so unsaved buffers are what the file tools read and edit: `read(path) -> str | None` (None: read the
    # disk) and `write(path, text) -> bool` (False: write the disk; ToolError when the editor fails).
    editor: Any = None
    # The editor's terminals when a front-end offers them (ACP's terminal/*), so the person watches the
    # command live where they work: `run(argv, cwd, env, timeout_s, cancel) -> TerminalRun` (agent/tools/
    # shell.py), which kills the command on timeout or cancel. None: shell runs it here, under the reaper.
    terminal: Any = None
    # Filled lazily by the semantic_search tool (index/ is imported only when used).
    search_index: Any = None
    _rg: str | None | bool = field(default=False, repr=False)

    @property
    def root(self) -> Path:
        return self.workspace.root

    @property
    def rg(self) -> str | None:
        if self._rg is False:
            self._rg = find_ripgrep() if self.use_ripgrep else None
        return self._rg  # type: ignore[return-value]

    @classmethod
    def for_root(cls, root: str | Path, **kw: Any) -> ToolContext:
        return cls(workspace=Workspace(Path(root)), **kw)
