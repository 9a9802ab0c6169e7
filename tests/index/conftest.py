"""Fixtures for the index tests: the real MiniLM model (loaded once per session: ~5 s) and small real
repositories made of standard-library modules (code nobody here wrote)."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import git

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Small, self-contained modules with distinct topics, so queries have one right answer.
MODULES = ["textwrap.py", "shlex.py", "colorsys.py", "fnmatch.py", "bisect.py", "heapq.py", "json"]


@pytest.fixture(scope="session")
def embedder():
    from index.embed import load_embedder

    return load_embedder()


def waiting(ix) -> list[str]:
    """The files a CodeIndex still embeds vectors for (sync.py's `info["unembedded"]`)."""
    return json.loads(ix.info().get("unembedded", "[]"))


def copy_modules(dst: Path, names=MODULES) -> None:
    for name in names:
        src = STDLIB / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)


def make_repo(repo: Path, names=MODULES) -> Path:
    """A git repository holding stdlib modules, committed."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "test@example.com")
    git(repo, "config", "user.name", "Test")
    copy_modules(repo, names)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "stdlib modules")
    return repo


@pytest.fixture(scope="session")
def _indexed_template(tmp_path_factory, embedder) -> Path:
    from index.code_index import CodeIndex

    repo = make_repo(tmp_path_factory.mktemp("template") / "repo")
    ix = CodeIndex(repo, embedder=embedder)
    ix.sync()
    ix.close()
    return repo


@pytest.fixture
def indexed_repo(_indexed_template: Path, tmp_path: Path) -> Path:
    """A git repository of stdlib modules with its index already built (copied: embedding the same
    files again in every test would cost seconds each)."""
    dst = tmp_path / "repo"
    shutil.copytree(_indexed_template, dst, symlinks=True)
    return dst
