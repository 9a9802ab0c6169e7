"""Suites that ship, by name. Synthetic suites are generated on the fly from seeds; the held-out
split uses a seed range training never draws from.

    synthetic          train split: every family x size, seeds 0..N-1
    synthetic-heldout  held-out split: the same families and sizes, seeds from 1,000,000, built from a
                       pool of modules and functions the train split never contains (families/pool.py)
    synthetic-small    train split, small size only (quick checks)
    js-small           JavaScript bug fixes verified with node's test runner (families/js.py), small and medium

`load_tasks` reads a suite by name or a tasks JSONL file.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from agent.tasks.families.pool import HELDOUT_BASE as HELDOUT_BASE  # where the seeds' meaning is defined
from agent.tasks.spec import Task, TaskError, read_jsonl

SUITES = ("synthetic", "synthetic-heldout", "synthetic-small", "js-small")


def synthetic(seeds: range, sizes: tuple[str, ...] = ("small", "medium", "large"), split: str = "train") -> list[Task]:
    from agent.tasks.families import FAMILIES, generate

    return [generate(f, s, size, split) for s in seeds for f in FAMILIES for size in sizes]


def builtin(name: str, n: int = 5) -> list[Task]:
    if name == "synthetic":
        return synthetic(range(n))
    if name == "synthetic-heldout":
        return synthetic(range(HELDOUT_BASE, HELDOUT_BASE + n), split="heldout")
    if name == "synthetic-small":
        return synthetic(range(n), sizes=("small",))
    if name == "js-small":
        from agent.tasks.families import generate

        return [generate("js-bugfix", s, size) for s in range(n) for size in ("small", "medium")]
    raise KeyError(name)


_PATH_FIELDS = ("workspace", "repo", "hidden")


def load_tasks(path: str | Path) -> list[Task]:
    """Tasks from a JSONL file (or a built-in suite name, see agent.tasks.suites)."""
    if str(path) in SUITES:
        return builtin(str(path))
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"{path}: no such task file (built-in suites: {', '.join(SUITES)})")
    names = {f.name for f in fields(Task)}
    tasks, seen = [], set()
    for n, raw in read_jsonl(path):
        unknown = set(raw) - names
        if unknown:
            raise TaskError(f"{path}:{n}: unknown fields {sorted(unknown)}")
        try:
            task = Task(**raw)
        except TypeError as e:
            raise TaskError(f"{path}:{n}: {e}") from None
        except TaskError as e:
            raise TaskError(f"{path}:{n}: {e}") from None
        resolved = {}
        for name in _PATH_FIELDS:
            value = getattr(task, name)
            if value:
                p = Path(value)
                p = p if p.is_absolute() else (path.parent / p).resolve()
                if not p.is_dir():
                    raise TaskError(f"{path}:{n}: {name} {p} is not a folder")
                resolved[name] = str(p)
        if task.generator:
            from agent.tasks.families import GENERATORS

            if task.generator not in GENERATORS:
                raise TaskError(f"{path}:{n}: unknown generator {task.generator!r} (known: {', '.join(GENERATORS)})")
        if task.id in seen:
            raise TaskError(f"{path}:{n}: duplicate task id {task.id!r}")
        seen.add(task.id)
        tasks.append(replace(task, **resolved))
    if not tasks:
        raise TaskError(f"{path}: no tasks")
    return tasks
