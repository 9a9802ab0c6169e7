"""The semantic_search tool end to end: registry, executor, ToolContext, a real git repository."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from agent.tools import Executor, ToolCall, ToolContext, default_registry
from tests.conftest import git

from .conftest import STDLIB


def call(ex: Executor, **args):
    return ex.run([ToolCall("c1", "semantic_search", json.dumps(args))])[0]


def test_the_tool_builds_syncs_and_searches(tmp_path: Path, embedder):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for name in ["textwrap.py", "heapq.py", "json"]:
        src = STDLIB / name
        (shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir()
         else shutil.copy2(src, repo / name))
    ctx = ToolContext.for_root(repo)
    ex = Executor(default_registry(), ctx)
    try:
        r = call(ex, query="wrap a paragraph of text to a fixed line width", k=3)
        assert r.ok, r.content
        assert r.content.startswith("built the index (no index yet)")
        assert "1. textwrap.py:" in r.content
        hits = r.data["hits"]
        assert hits[0]["path"] == "textwrap.py" and len(hits) == 3
        assert set(hits[0]) == {"path", "start_line", "end_line", "symbol", "score"}

        # A file added after the first call is found, and the tool says it indexed it.
        shutil.copy2(STDLIB / "getopt.py", repo / "getopt.py")
        r = call(ex, query="parse command line options like the unix getopt function", k=2)
        assert r.ok and r.content.startswith("indexed 1 changed file (1 added)")
        assert r.data["hits"][0]["path"] == "getopt.py"

        # Nothing changed: no notice, just results; restricted to a folder.
        r = call(ex, query="decode a JSON document", k=4, path="json")
        assert r.ok and not r.data["notes"]
        assert {h["path"].split("/")[0] for h in r.data["hits"]} == {"json"}
        assert r.content.startswith("1. json/")

        # Two calls in one turn run concurrently on the shared index.
        both = ex.run([ToolCall("a", "semantic_search", '{"query": "heap push pop"}'),
                       ToolCall("b", "semantic_search", '{"query": "text dedent", "k": 12}')])
        assert all(x.ok for x in both)
        assert both[0].data["hits"][0]["path"] == "heapq.py"
        assert len(both[1].data["hits"]) == 12
        # What a card shows: one line per hit, path:lines and the symbol.
        from agent.render import hit_lines

        hits = both[1].data["hits"]
        for line, h in zip(hit_lines(hits, limit=len(hits)), hits, strict=True):
            where = f"{h['path']}:{h['start_line']}-{h['end_line']}"
            assert line == (f"{where}: {h['symbol']}" if h["symbol"] else where)
        assert any(h["symbol"] for h in hits)

        # The index stays out of git: nothing under the state folder shows up as untracked.
        assert git(repo, "status", "--porcelain", "--untracked-files=all", "--", ".composer") == ""
        assert (repo / ".composer" / "index" / "meta.sqlite").is_file()
    finally:
        ex.close()


def test_the_tool_reports_bad_arguments(indexed_repo: Path, embedder):
    ex = Executor(default_registry(), ToolContext.for_root(indexed_repo))
    try:
        r = call(ex, query="   ")
        assert not r.ok and "query is empty" in r.content
        r = call(ex, query="x", path="../")
        assert not r.ok and "outside the workspace" in r.content
        r = call(ex, query="x", path="no_such_dir")
        assert not r.ok and "does not exist" in r.content
        r = call(ex, query="x", k=0)
        assert not r.ok and "invalid arguments" in r.content
    finally:
        ex.close()


def test_the_tool_spec_is_unchanged_in_shape():
    spec = default_registry().get("semantic_search").spec()["function"]
    assert spec["name"] == "semantic_search"
    assert set(spec["parameters"]["properties"]) == {"query", "k", "path"}
    assert spec["parameters"]["required"] == ["query"]


def test_a_first_search_in_a_large_repository_answers_before_the_index_is_complete(
        tmp_path: Path, embedder, monkeypatch):
    import re

    from agent.tools import semantic_search as tool_module
    from index import sync

    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ["bisect.py", "colorsys.py", "fnmatch.py"]:
        shutil.copy2(STDLIB / name, repo / name)
    monkeypatch.setattr(sync, "BATCH_CHUNKS", 4)
    monkeypatch.setattr(tool_module, "SYNC_BUDGET_S", 0.0)  # one batch of vectors a call
    ex = Executor(default_registry(), ToolContext.for_root(repo))
    try:
        r = call(ex, query="convert rgb color to hls", k=2)
        # every file is in after the first call, by its words; the vectors follow call by call
        assert r.ok and "built the index" in r.content and "3 files, " in r.content
        waiting = [int(re.search(r"the vectors of (\d+) files? follow", r.content).group(1))]
        assert r.data["hits"][0]["path"] == "colorsys.py"
        while "follow on the next searches" in r.content:
            r = call(ex, query="convert rgb color to hls", k=2)
            assert r.ok and r.data["hits"][0]["path"] == "colorsys.py"
            m = re.search(r"the vectors of (\d+) files? follow", r.content)
            waiting.append(int(m.group(1)) if m else 0)
            assert len(waiting) < 20
        assert waiting == sorted(waiting, reverse=True) and waiting[0] >= 2 and waiting[-1] == 0
        assert "embedded" in r.content  # the last call's note
        r = call(ex, query="insert an item into a sorted list", k=2)
        assert r.ok and r.data["hits"][0]["path"] == "bisect.py" and not r.data["notes"]
    finally:
        ex.close()


def test_an_empty_workspace_says_so(tmp_path: Path, embedder):
    ex = Executor(default_registry(), ToolContext.for_root(tmp_path))
    try:
        r = call(ex, query="anything at all")
        assert r.ok and "nothing is indexed in this workspace yet" in r.content
        assert r.data["hits"] == []
    finally:
        ex.close()


def test_without_the_index_extra_the_tool_points_to_grep(tmp_path: Path, monkeypatch):
    from agent.tools import semantic_search as tool_module

    monkeypatch.setattr(tool_module, "INDEX_MODULES", ("faiss", "no_such_module_xyz"))
    ex = Executor(default_registry(), ToolContext.for_root(tmp_path))
    try:
        r = call(ex, query="anything")
        assert not r.ok and "no_such_module_xyz missing" in r.content and "grep" in r.content
        assert not (tmp_path / ".composer").exists()  # nothing was created
    finally:
        ex.close()
