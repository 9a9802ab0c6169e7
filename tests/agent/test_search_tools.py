"""grep, glob and list_dir on a real git repository, with ripgrep and with the pure-Python fallback."""

from __future__ import annotations

import os
import time

import pytest

from agent.tools.context import find_ripgrep

from ..conftest import git
from .helpers import Tools


@pytest.fixture
def repo(git_repo):
    files = {
        ".gitignore": "build/\n*.log\n!keep.log\n",
        "README.md": "# Project\nTODO: write docs\n",
        "src/app.py": "import os\n\n\ndef main():\n    # TODO: handle args\n    print('Hello')\n    return 0\n",
        "src/util.py": "def helper(x):\n    return x * 2  # todo lower\n",
        "src/web/index.ts": "export function hello(): string {\n  return 'TODO';\n}\n",
        "src/web/style.css": "body { color: red; }\n",
        "build/out.py": "# TODO generated\n",
        "debug.log": "TODO in a log\n",
        "keep.log": "TODO kept\n",
        ".github/workflows/ci.yml": "# TODO ci\n",
        "docs/sub/deep/more/x.md": "deep TODO\n",
    }
    for rel, text in files.items():
        p = git_repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (git_repo / "blob.bin").write_bytes(b"TODO\x00\x01\x02")
    git(git_repo, "add", "-A")
    git(git_repo, "commit", "-qm", "init")
    return git_repo


BACKENDS = ["rg", "python"]


@pytest.fixture(params=BACKENDS)
def tools(request, repo):
    if request.param == "rg" and not find_ripgrep():
        pytest.skip("rg is not installed")
    t = Tools(repo, use_ripgrep=request.param == "rg")
    assert (t.ctx.rg is not None) == (request.param == "rg")
    return t


def test_grep_files_with_matches_sorted_and_gitignore_aware(tools):
    out = tools.ok("grep", pattern="TODO")
    assert out.splitlines() == [
        "6 file(s) match:",
        ".github/workflows/ci.yml",  # hidden files are searched
        "README.md",
        "docs/sub/deep/more/x.md",
        "keep.log",  # re-included by !keep.log; debug.log and build/ stay ignored
        "src/app.py",
        "src/web/index.ts",
    ]


def test_the_repository_exclude_file_is_respected_like_gitignore(tools, repo):
    (repo / "scratch").mkdir()
    (repo / "scratch" / "notes.md").write_text("TODO private\n")
    (repo / "mine.txt").write_text("TODO mine\n")
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "exclude").write_text("scratch/\n*.txt\n")
    out = tools.ok("grep", pattern="TODO").splitlines()
    assert "scratch/notes.md" not in out and "mine.txt" not in out and "src/app.py" in out
    assert "mine.txt" not in tools.ok("glob", pattern="*.txt")


def test_grep_case_insensitive_and_glob_and_path(tools):
    out = tools.ok("grep", pattern="todo", case_insensitive=True, glob="*.py")
    assert out.splitlines()[1:] == ["src/app.py", "src/util.py"]
    out = tools.ok("grep", pattern="TODO", path="src/web")
    assert out.splitlines()[1:] == ["src/web/index.ts"]
    out = tools.ok("grep", pattern="TODO", path="src", glob="web/*.ts")
    assert out.splitlines()[1:] == ["src/web/index.ts"]
    out = tools.ok("grep", pattern="helper", path="src/util.py", output_mode="content")
    assert out.splitlines()[1:] == ["src/util.py:1:def helper(x):"]


def test_grep_content_with_context(tools):
    out = tools.ok("grep", pattern="TODO: handle", output_mode="content", context=1)
    assert out.splitlines() == [
        "1 matching line(s) in 1 file(s):",
        "src/app.py-4-def main():",
        "src/app.py:5:    # TODO: handle args",
        "src/app.py-6-    print('Hello')",
    ]


def test_grep_count_and_head_limit(tools):
    out = tools.ok("grep", pattern="o", output_mode="count", glob="*.py")
    assert "src/app.py:" in out and "src/util.py:1" in out
    out = tools.ok("grep", pattern="TODO", head_limit=2)
    assert out.splitlines()[1:3] == [".github/workflows/ci.yml", "README.md"]
    assert "output capped" in out


def test_grep_no_match_and_bad_pattern(tools):
    assert tools.ok("grep", pattern="NoSuchTextAnywhere").startswith("No matches")
    assert "invalid pattern" in tools.err("grep", pattern="(unclosed")
    assert "does not exist" in tools.err("grep", pattern="x", path="nope")


def test_grep_skips_binary_files(tools):
    assert "blob.bin" not in tools.ok("grep", pattern="TODO")


def test_grep_works_outside_git(tmp_path):
    (tmp_path / ".gitignore").write_text("skip.txt\n")
    (tmp_path / "skip.txt").write_text("needle\n")
    (tmp_path / "take.txt").write_text("needle\n")
    for use_rg in (True, False):
        out = Tools(tmp_path, use_ripgrep=use_rg).ok("grep", pattern="needle")
        assert out.splitlines()[1:] == ["take.txt"], (use_rg, out)


def test_glob_newest_first_and_gitignore(tools, repo):
    now = time.time()
    os.utime(repo / "src/util.py", (now - 100, now - 100))
    os.utime(repo / "src/app.py", (now, now))
    out = tools.ok("glob", pattern="**/*.py")
    assert out.splitlines()[1:] == ["src/app.py", "src/util.py"]
    out = tools.ok("glob", pattern="*.ts")
    assert out.splitlines()[1:] == ["src/web/index.ts"]
    out = tools.ok("glob", pattern="web/*", path="src")
    assert sorted(out.splitlines()[1:]) == ["src/web/index.ts", "src/web/style.css"]
    assert tools.ok("glob", pattern="*.nothing").startswith("No files")
    assert "keep.log" in tools.ok("glob", pattern="*.log") and "debug.log" not in tools.ok("glob", pattern="*.log")


def test_list_dir_tree(tools):
    out = tools.ok("list_dir")
    lines = out.splitlines()
    assert lines[0].startswith("./ (")
    assert "src/" in lines and "  web/" in lines and "    index.ts" in lines
    assert "build/" not in lines and "debug.log" not in lines and ".git/" not in lines
    assert ".github/" in lines
    assert "    deep/ (1 file(s))" in lines  # three levels shown, deeper ones summarised
    out = tools.ok("list_dir", path="src/web")
    assert out.splitlines() == ["src/web/ (2 file(s))", "index.ts", "style.css"]
    assert "is a file" in tools.err("list_dir", path="README.md")


def test_list_dir_caps_wide_folders(tmp_path):
    for i in range(100):
        (tmp_path / f"f{i:03}.txt").write_text("x")
    out = Tools(tmp_path).ok("list_dir")
    assert "… 60 more entries" in out


def test_a_glob_never_overrides_gitignore(tools):
    assert tools.ok("grep", pattern="TODO", glob="*.log").splitlines()[1:] == ["keep.log"]
    assert tools.ok("grep", pattern="TODO", glob="**/*.py").splitlines()[1:] == ["src/app.py"]
    out = tools.ok("grep", pattern="TODO", glob="!*.md")
    assert "README.md" not in out and "src/app.py" in out
