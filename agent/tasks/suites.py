"""Suites that ship, by name. Synthetic suites are generated on the fly from seeds; the held-out
split uses a seed range training never draws from.

    synthetic          train split: every family x size, seeds 0..N-1
    synthetic-heldout  held-out split: the same families and sizes, seeds from 1,000,000, built from a
                       pool of modules and functions the train split never contains (families/pool.py)
    synthetic-small    train split, small size only (quick checks)
"""

from __future__ import annotations

from agent.tasks.spec import Task

HELDOUT_BASE = 1_000_000
SUITES = ("synthetic", "synthetic-heldout", "synthetic-small")


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
    raise KeyError(name)
