"""The task spec: a small dataclass, one JSON object per line on disk.

    {"id": "fix-add", "workspace": "repos/calc", "prompt": "the add test fails, fix it",
     "verify": "python -m pytest -q", "max_turns": 8, "max_time_s": 120, "token_budget": null,
     "tag": "easy", "expected_tokens": 300}

`workspace` is a folder (relative paths are resolved against the JSONL file's folder) copied afresh
for every episode; `verify` runs in that copy after the episode and is never shown to the agent (it is
not in the workspace while the agent runs). Limits bound the episode; `tag` names the family or
difficulty; `expected_tokens` (optional) tells the length penalty how long a good answer is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


class TaskError(ValueError):
    """A task file or task that cannot be used (the message names the line and the field)."""


@dataclass(frozen=True)
class Task:
    id: str
    """Unique within a suite."""
    workspace: str
    """Folder copied for every episode (absolute once loaded)."""
    prompt: str
    """What the user asks: short and underspecified, like real requests."""
    verify: str
    """Shell command run in the episode's workspace afterwards; exit 0 means solved."""
    max_turns: int = 10
    """Model turns per episode."""
    max_time_s: float | None = 300.0
    """Wall time per episode."""
    token_budget: int | None = None
    """Tokens (prompt + completion) per episode."""
    verify_timeout_s: float = 120.0
    """The verify command is killed after this long (and the episode counts as not solved)."""
    tag: str = ""
    """Family or difficulty."""
    expected_tokens: int | None = None
    """How many completion tokens a good solution needs (scales the length penalty)."""

    def __post_init__(self) -> None:
        if not self.id or not self.prompt or not self.verify:
            raise TaskError(f"task {self.id!r}: id, prompt and verify must be non-empty")
        if self.max_turns < 1:
            raise TaskError(f"task {self.id!r}: max_turns must be at least 1")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def load_tasks(path: str | Path) -> list[Task]:
    path = Path(path)
    names = {f.name for f in fields(Task)}
    tasks, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{n}: not JSON: {e}") from None
        unknown = set(raw) - names
        if unknown:
            raise TaskError(f"{path}:{n}: unknown fields {sorted(unknown)}")
        try:
            task = Task(**raw)
        except TypeError as e:
            raise TaskError(f"{path}:{n}: {e}") from None
        ws = Path(task.workspace)
        ws = ws if ws.is_absolute() else (path.parent / ws).resolve()
        if not ws.is_dir():
            raise TaskError(f"{path}:{n}: workspace {ws} is not a folder")
        if task.id in seen:
            raise TaskError(f"{path}:{n}: duplicate task id {task.id!r}")
        seen.add(task.id)
        tasks.append(Task(**{**task.as_dict(), "workspace": str(ws)}))
    if not tasks:
        raise TaskError(f"{path}: no tasks")
    return tasks
