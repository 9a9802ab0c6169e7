"""Varied environments for training episodes (domain randomization).

The system prompt names the workspace folder, the date and the git state. A small model whose
training episodes all ran in /tmp/composer-<task id>-<random>/repo, on one day, outside git, learns
those bytes along with the task, and its greedy choices then shift when a user's folder, date or
branch differ. With a variation an episode runs in a folder of another shape (a real folder), in half
of them inside a real git repository on some branch, and its system prompt names another date (the
one thing not real: `system_prompt(date=...)`). Drawn from a key (task id and repeat), so a run reproduces.
"""

from __future__ import annotations

import datetime
import random
from dataclasses import dataclass

PREFIXES = ("", "composer-", "demo-", "pytest-", "work-", "ws-", "agent-", "run-")
DIRS = ("projects", "code", "src", "work", "repos", "dev", "home", "alex", "sam", "build", "checkout",
        "pytest-of-root", "pytest-12", "test_run_0", "tmp", "users", "git", "2026", "ci", "data")
NAMES = ("repo", "d", "project", "app", "demo", "demo-repo", "lib", "service", "tools", "pkg-src", "workspace",
         "mylib", "stats-lib", "core", "backend", "scripts", "utils", "calc", "example", "w")
BRANCHES = ("main", "master", "dev", "develop", "trunk", "fix-tests", "feature/cache", "bugfix/stats", "wip")
FIRST_DAY, DAYS = datetime.date(2024, 1, 1), 7 * 365


@dataclass(frozen=True)
class Variation:
    prefix: str  # of the temporary folder's name
    dirs: tuple[str, ...]  # folders between it and the workspace
    name: str  # the workspace folder's name
    branch: str | None  # a git repository on this branch; None: not a repository
    date: str  # YYYY-MM-DD, as the system prompt writes it


def draw(key: str) -> Variation:
    rng = random.Random(key)
    return Variation(
        prefix=rng.choice(PREFIXES),
        dirs=tuple(rng.sample(DIRS, rng.randint(0, 3))),
        name=rng.choice(NAMES),
        branch=rng.choice(BRANCHES) if rng.random() < 0.5 else None,
        date=(FIRST_DAY + datetime.timedelta(days=rng.randrange(DAYS))).isoformat(),
    )
