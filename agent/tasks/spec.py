"""The task spec: one small dataclass for RL training and for `composer-agent eval`; JSONL on disk.

    {"id": "bugfix-small-17", "prompt": "the tests in tests/test_shapes.py fail, can you fix it?",
     "verify": "python -m pytest -q -p no:cacheprovider _hidden",
     "generator": "bugfix", "seed": 17, "size": "small",
     "max_turns": 12, "max_time_s": 300, "token_budget": null, "family": "bugfix", "split": "train"}

The workspace comes from exactly one source: `workspace` (a folder, copied), `repo` + `commit` (a
git repository checked out at that commit in a private clone), or `generator` + `seed` (+ `size`; a
synthetic family writes the files, see agent/tasks/families/). Relative paths are resolved against
the JSONL file's folder. The verify command runs in the episode's workspace after the episode and is
never shown to the agent: files it needs (hidden tests) come from `hidden` (a folder) or
`hidden_patch` (a diff applied with `git apply`), or from the generator, and are put in place only
after the agent has finished. The agent's final answer is in the file named by $COMPOSER_ANSWER_FILE
(for questions answered in text). `split` "heldout" marks tasks training must never see.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SPLITS = ("", "train", "heldout")


class TaskError(ValueError):
    """A task file or task that cannot be used (the message names the line and the field)."""


@dataclass(frozen=True)
class Task:
    id: str
    """Unique within a suite."""
    prompt: str
    """What the user asks: short and underspecified, like real requests."""
    verify: str
    """Shell command run in the episode's workspace afterwards; exit 0 means solved."""
    workspace: str = ""
    """A folder copied for every episode."""
    repo: str = ""
    """A git repository, checked out at `commit` in a private clone for every episode."""
    commit: str = ""
    """The commit of `repo` (default: its HEAD)."""
    generator: str = ""
    """A synthetic family that writes the workspace (agent.tasks.families)."""
    seed: int = 0
    """The generator's seed."""
    size: str = "small"
    """The generator's size: small | medium | large."""
    hidden: str = ""
    """A folder copied into the workspace only for verification."""
    hidden_patch: str = ""
    """A diff applied (git apply) only for verification, e.g. SWE-bench's test_patch."""
    max_turns: int = 12
    """Model turns per episode."""
    max_time_s: float | None = 300.0
    """Wall time per episode."""
    token_budget: int | None = None
    """Tokens (prompt + completion) per episode."""
    verify_timeout_s: float = 120.0
    """The verify command is killed after this long (the episode then counts as not solved)."""
    family: str = ""
    """Family or suite name (bugfix, find-def, rename, add-param, stdlib-bug, swe)."""
    tag: str = ""
    """Difficulty or any label."""
    split: str = ""
    """train | heldout | empty. Training refuses heldout tasks."""
    expected_tokens: int | None = None
    """How many completion tokens a good solution needs (scales the length penalty)."""
    meta: dict[str, Any] | None = None
    """Anything else worth keeping (the injected bug, the failing test, ...)."""
    reference_patch: str | None = None
    """A known fix as a unified diff, from builders that know it (SWE rows' `patch`): the quality metrics
    compare an episode's diff with it. "" means the task needs no change (a question); None: not known."""

    def __post_init__(self) -> None:
        if not self.id or not self.prompt or not self.verify:
            raise TaskError(f"task {self.id!r}: id, prompt and verify must be non-empty")
        sources = [bool(self.workspace), bool(self.repo), bool(self.generator)]
        if sum(sources) != 1:
            raise TaskError(f"task {self.id!r}: give exactly one workspace source (workspace, repo or generator)")
        if self.commit and not self.repo:
            raise TaskError(f"task {self.id!r}: commit needs repo")
        if self.max_turns < 1:
            raise TaskError(f"task {self.id!r}: max_turns must be at least 1")
        if self.split not in SPLITS:
            raise TaskError(f"task {self.id!r}: split must be one of {SPLITS[1:]} or empty")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> str:
        defaults = {f.name: f.default for f in fields(Task)}
        return json.dumps({k: v for k, v in self.as_dict().items() if k in ("id", "prompt", "verify") or v != defaults[k]})



def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-empty line; a line that is not a JSON object is a TaskError."""
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{n}: not JSON: {e}") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}:{n}: a JSON object was expected")
        rows.append((n, row))
    return rows


def write_tasks(tasks: list[Task], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(t.to_json() + "\n" for t in tasks))
    return path
