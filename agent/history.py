"""Input history shared by the TUI and line mode: `.composer/history` in the workspace.

The file format is prompt-toolkit's FileHistory format (a `# timestamp` line, then each line of the
entry prefixed with `+`), so multi-line entries survive and the file stays readable. Entries are only
appended, never rewritten, so two sessions in one repository cannot lose each other's lines.
"""

from __future__ import annotations

import datetime
from pathlib import Path

MAX_ENTRIES = 1000


def history_path(root: Path) -> Path:
    from agent.tools.context import STATE_DIR, Workspace  # lazily: the tools package is not needed to paint

    try:
        return Workspace(root).state_dir() / "history"  # creates .composer/ with its .gitignore
    except OSError:
        return Path(root) / STATE_DIR / "history"


def load(path: Path, limit: int = MAX_ENTRIES) -> list[str]:
    """Entries oldest first, consecutive duplicates folded, at most the last `limit`."""
    try:
        raw = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return []
    entries: list[str] = []
    lines: list[str] = []
    for line in raw.splitlines():
        if line.startswith("+"):
            lines.append(line[1:])
            continue
        if lines:
            entries.append("\n".join(lines))
            lines = []
    if lines:
        entries.append("\n".join(lines))
    folded = [e for i, e in enumerate(entries) if i == 0 or e != entries[i - 1]]
    return folded[-limit:]


def append(path: Path, entry: str) -> None:
    if not entry.strip():
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"\n# {datetime.datetime.now()}\n" + "".join(f"+{ln}\n" for ln in entry.split("\n")))
    except OSError:
        pass  # a read-only workspace loses history, not the session


class Cursor:
    """Walking the history with ↑/↓ while keeping the draft being typed (like a shell)."""

    def __init__(self, entries: list[str]):
        self.entries = entries
        self.pos = len(entries)  # len(entries) means "the draft"
        self.draft = ""

    def older(self, current: str) -> str | None:
        if self.pos == 0:
            return None
        if self.pos == len(self.entries):
            self.draft = current
        self.pos -= 1
        return self.entries[self.pos]

    def newer(self) -> str | None:
        if self.pos >= len(self.entries):
            return None
        self.pos += 1
        return self.draft if self.pos == len(self.entries) else self.entries[self.pos]

    def add(self, entry: str) -> None:
        if entry.strip() and (not self.entries or self.entries[-1] != entry):
            self.entries.append(entry)
        self.pos, self.draft = len(self.entries), ""
