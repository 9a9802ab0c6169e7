"""lint (ruff with the project's config, configured linters) and todo_write."""

from __future__ import annotations

from .helpers import Tools


def test_lint_reports_file_line_diagnostics(tmp_path):
    (tmp_path / "ok.py").write_text("X = 1\n")
    (tmp_path / "bad.py").write_text("import os\n\n\ndef f():\n    return undefined\n")
    t = Tools(tmp_path)
    r = t.call("lint")
    assert r.ok and r.data["problems"] == 2
    assert "bad.py:1:8: F401" in r.content and "bad.py:5:12: F821" in r.content
    r = t.call("lint", paths=["ok.py"])
    assert r.content == "ruff: no problems" and r.data["problems"] == 0


def test_lint_uses_the_project_ruff_config(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.ruff.lint]\nselect = ["E711"]\n')
    (tmp_path / "a.py").write_text("import os\nif os == None:\n    pass\n")
    r = Tools(tmp_path).call("lint")
    assert "E711" in r.content and "F401" not in r.content


def test_lint_runs_configured_linters(tmp_path):
    (tmp_path / "notes.txt").write_text("fine\nTODO fix\n")
    t = Tools(tmp_path)
    t.ctx.linters = {"*.txt": "grep -n -H TODO {paths} || true"}
    r = t.call("lint")
    assert "grep: 1 problem line(s)" in r.content and "notes.txt:2:TODO fix" in r.content


def test_lint_missing_path(tmp_path):
    assert "does not exist" in Tools(tmp_path).err("lint", paths=["nope.py"])


def test_todo_write_replaces_and_renders(tmp_path):
    t = Tools(tmp_path)
    out = t.ok("todo_write", todos=[{"content": "read code", "status": "completed"},
                                    {"content": "fix bug", "status": "in_progress"},
                                    {"content": "run tests", "status": "pending"}])
    assert out.splitlines() == ["Todos (1/3 done):", "[x] read code", "[~] fix bug", "[ ] run tests"]
    assert t.ctx.todos[1] == {"content": "fix bug", "status": "in_progress"}
    t.ok("todo_write", todos=[])
    assert t.ctx.todos == []
    assert "is not one of" in t.err("todo_write", todos=[{"content": "x", "status": "done"}])
    assert "empty content" in t.err("todo_write", todos=[{"content": "  ", "status": "pending"}])


def test_semantic_search_is_in_the_contract(tmp_path):
    r = Tools(tmp_path).call("semantic_search", query="where is the config parsed")
    assert r.content.startswith("Error: ") or r.ok
