"""`composer-agent index` / `search` through index/cli.py: flags, JSON output, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from index.cli import main_index, main_search

from .conftest import STDLIB

ROOT = Path(__file__).resolve().parents[2]


def test_index_reports_what_it_did(indexed_repo: Path, embedder, capsys):
    assert main_index([], indexed_repo) == 0
    assert capsys.readouterr().out.startswith("index up to date:")
    shutil.copy2(STDLIB / "getopt.py", indexed_repo / "getopt.py")
    (indexed_repo / "blob.bin").write_bytes(b"\0" * 64)
    assert main_index(["--json"], indexed_repo) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["added"] == ["blob.bin", "getopt.py"] and report["skipped"] == {"binary": 1}
    assert report["summary"].startswith("indexed 2 changed files")


def test_search_json_syncs_first_and_ranks_best_first(indexed_repo: Path, embedder, capsys):
    shutil.copy2(STDLIB / "getopt.py", indexed_repo / "getopt.py")  # added after indexing
    rc = main_search(["parse command line options like the unix getopt function", "-k", "4", "--json"],
                     indexed_repo)
    out, err = capsys.readouterr()
    assert rc == 0
    hits = json.loads(out)  # stdout is only the JSON array; the sync notice went to stderr
    assert "indexed 1 changed file" in err
    assert 1 <= len(hits) <= 4
    assert hits[0]["path"] == "getopt.py"
    for h in hits:
        assert {"path", "start_line", "end_line", "symbol", "score", "text"} <= set(h)
        assert h["start_line"] <= h["end_line"]
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True)


def test_search_plain_output_and_path_filter(indexed_repo: Path, embedder, capsys):
    assert main_search(["decode a JSON document", "--path", "json", "-k", "3"], indexed_repo) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert len(heads) == 3 and all(h.startswith("json/") for h in heads)


@pytest.mark.parametrize("argv, message", [
    (["q", "-k", "0"], "-k must be at least 1"),
    (["   "], "the query is empty"),
    (["q", "--path", "/"], "is not inside the workspace"),
])
def test_search_usage_errors(indexed_repo: Path, argv, message, capsys):
    assert main_search(argv, indexed_repo) == 2
    assert message in capsys.readouterr().err


def test_help_and_unknown_flags(tmp_path: Path, capsys):
    assert main_index(["--help"], tmp_path) == 0
    assert "composer-agent index" in capsys.readouterr().out
    assert main_search(["q", "--bogus"], tmp_path) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_model_folder_that_does_not_exist_is_a_clear_error(tmp_path: Path, capsys):
    assert main_index(["--model", str(tmp_path / "missing-model")], tmp_path) == 1
    assert "no such model folder" in capsys.readouterr().err


def test_a_missing_model_is_a_clear_error(tmp_path: Path, capsys):
    (tmp_path / "notamodel").mkdir()
    assert main_index(["--model", str(tmp_path / "notamodel")], tmp_path) == 1
    assert "not a sentence-transformers model folder" in capsys.readouterr().err


@pytest.mark.slow
def test_search_json_in_a_fresh_process(indexed_repo: Path):
    code = ("import sys; from pathlib import Path; from index.cli import main_search; "
            "sys.exit(main_search(sys.argv[2:], Path(sys.argv[1])))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, str(indexed_repo), "heap queue push pop", "--json",
                           "-k", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    hits = json.loads(proc.stdout)
    assert [h["path"] for h in hits][0] == "heapq.py"


def test_the_interactive_index_command_refreshes_the_index(indexed_repo: Path, embedder):
    from agent.config import Config
    from agent.interactive import Interactive
    from agent.scripted import DeterministicModel

    shutil.copy2(STDLIB / "getopt.py", indexed_repo / "getopt.py")
    ui = Interactive(Config(), indexed_repo, emit=lambda e: None, model=DeterministicModel([]))
    try:
        out = ui.command("/index")
        assert not out.error and "indexed 1 changed file (1 added)" in out.text
        again = ui.command("/index")
        assert not again.error and again.text.startswith("index up to date:")
    finally:
        ui.close()
