"""A build killed mid-way (SIGKILL, a real subprocess) leaves the previous index usable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from index.code_index import CodeIndex

from .conftest import copy_modules, waiting

ROOT = Path(__file__).resolve().parents[2]


def start_build(repo: Path, setup: str = "", stderr=subprocess.PIPE) -> subprocess.Popen:
    """`composer-agent index` on `repo` in a real subprocess; `setup` runs first (a setting to change)."""
    code = (f"import sys; from pathlib import Path; {setup}"
            "from index.cli import main_index; sys.exit(main_index([], Path(sys.argv[1])))")
    return subprocess.Popen([sys.executable, "-c", code, str(repo)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def kill_when(proc: subprocess.Popen, ready) -> None:
    """SIGKILL the build once `ready()` says so (polled); fails if it ended first."""
    try:
        deadline = time.monotonic() + 240  # importing torch alone took 60-100 s on busy shared cores
        while time.monotonic() < deadline and proc.poll() is None and not ready():
            time.sleep(0.05)
        assert proc.poll() is None, "the build finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_sigkill_while_embedding_keeps_the_committed_rows_and_the_next_sync_embeds_the_rest(
        indexed_repo: Path, embedder):
    before = CodeIndex(indexed_repo, embedder=embedder)
    gen = int(before.info()["gen"])
    n_before = before._current().vectors.ntotal
    # Enough new code (~150 chunks) that embedding takes seconds, so the kill lands in the middle.
    copy_modules(indexed_repo, ["argparse.py", "getopt.py"])
    proc = start_build(indexed_repo)
    started: list[float] = []

    def embedding_for_a_second() -> bool:  # the build announces embedding; let it run into it
        if not started:
            line = proc.stderr.readline()
            if line.startswith("embedding "):
                started.append(time.monotonic())
            return False
        return time.monotonic() - started[0] >= 1.0

    kill_when(proc, embedding_for_a_second)
    assert started, "the build never started embedding"

    after = CodeIndex(indexed_repo, embedder=embedder)
    # The rows of both files were committed before embedding began (one generation), their vectors not.
    assert int(after.info()["gen"]) == gen + 1
    assert after._current().vectors.ntotal == n_before
    assert sorted(waiting(after)) == ["argparse.py", "getopt.py"]
    assert after.search("wrap a paragraph of text to a fixed line width", 3)[0].path == "textwrap.py"
    assert "getopt.py" in {h.path for h in after.search("getopt long options", 3)}  # by its words
    # The lock died with the process; the next sync embeds what was left and cleans the leftovers.
    r = after.sync()
    assert r.changed == 0 and r.rebuilt is None and r.embedded > 0 and r.pending == 0
    assert after._current().vectors.ntotal == n_before + r.embedded and waiting(after) == []
    assert not [p.name for p in after.dir.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_sigkill_after_some_batches_keeps_them_and_the_next_sync_finishes(indexed_repo: Path, embedder):
    before = CodeIndex(indexed_repo, embedder=embedder)
    gen = int(before.info()["gen"])
    n_before = before._current().vectors.ntotal
    new = {"argparse.py", "calendar.py", "difflib.py", "getopt.py", "pprint.py"}
    copy_modules(indexed_repo, sorted(new))
    # Small batches, so that several commits happen within the build (the setting, not the code path,
    # is what the test changes).
    proc = start_build(indexed_repo, "import index.sync; index.sync.BATCH_CHUNKS = 20; ", stderr=subprocess.DEVNULL)
    kill_when(proc, lambda: int(before.info().get("gen", gen)) >= gen + 3)  # the rows, then two batches

    after = CodeIndex(indexed_repo, embedder=embedder)
    assert new <= {r[0] for r in after._con.execute("SELECT path FROM files")}  # every file's rows
    kept = after._current().vectors.ntotal - n_before
    assert kept >= 40 and waiting(after)  # two batches of vectors, not all
    assert after.search("wrap a paragraph of text to a fixed line width", 1)[0].path == "textwrap.py"
    r = after.sync()
    assert r.rebuilt is None and r.changed == 0 and waiting(after) == []
    # One vector per definition of the new files: those embedded before the kill, and the rest now.
    assert kept + r.embedded == len({(p, u) for p, u in after._con.execute("SELECT path, unit FROM chunks")
                                     if p in new and u})
