"""The controller shared by the TUI and line mode: checkpoints and /undo, @mentions, slash commands."""

from __future__ import annotations

import pytest

from agent.checkpoint import CheckpointError, Checkpoints
from agent.config import Config
from agent.interactive import COMMANDS, Interactive, help_text
from agent.mentions import complete, expand, mentioned_paths, score
from agent.scripted import DeterministicModel
from agent.tools import ToolContext

from ..conftest import git


def test_checkpoints_restore_edits_creations_and_deletions_without_touching_git(git_repo):
    (git_repo / "keep.txt").write_text("v1\n")
    (git_repo / "gone.txt").write_text("will be deleted\n")
    (git_repo / ".gitignore").write_text("*.log\n")
    git(git_repo, "add", "-A")
    git(git_repo, "commit", "-qm", "init")
    (git_repo / "keep.txt").write_text("v2 staged\n")
    git(git_repo, "add", "keep.txt")
    head, status = git(git_repo, "rev-parse", "HEAD"), git(git_repo, "status", "--porcelain")
    cp = Checkpoints(git_repo)
    cp.snapshot("turn 1")
    (git_repo / "keep.txt").write_text("v3 by the agent\n")
    (git_repo / "gone.txt").unlink()
    (git_repo / "new" / "deep").mkdir(parents=True)
    (git_repo / "new" / "deep" / "file.py").write_text("x = 1\n")
    (git_repo / "build.log").write_text("ignored\n")
    changed = cp.undo()
    assert changed == ["gone.txt", "keep.txt", "new/deep/file.py"]
    assert (git_repo / "keep.txt").read_text() == "v2 staged\n"
    assert (git_repo / "gone.txt").read_text() == "will be deleted\n"
    assert not (git_repo / "new").exists()
    assert (git_repo / "build.log").exists()  # ignored files are not ours to touch
    assert git(git_repo, "rev-parse", "HEAD") == head
    assert git(git_repo, "status", "--porcelain") == status
    assert git(git_repo, "stash", "list") == ""
    with pytest.raises(CheckpointError, match="nothing (more )?to undo"):
        cp.undo()


def test_checkpoints_work_outside_git(tmp_path):
    (tmp_path / "a.txt").write_text("one\n")
    cp = Checkpoints(tmp_path)
    cp.snapshot("t1")
    (tmp_path / "a.txt").write_text("two\n")
    cp.snapshot("t2")
    (tmp_path / "a.txt").write_text("three\n")
    assert cp.undo() == ["a.txt"] and (tmp_path / "a.txt").read_text() == "two\n"
    assert cp.undo() == ["a.txt"] and (tmp_path / "a.txt").read_text() == "one\n"


def test_fuzzy_completion_prefers_names_and_word_starts():
    files = ["agent/tools/edit_file.py", "agent/tools/edit_match.py", "tests/agent/test_edit_file.py",
             "docs/editing.md", "agent/loop.py"]
    assert complete("edfile", files)[0] == "agent/tools/edit_file.py"
    assert complete("loop", files) == ["agent/loop.py"]
    assert complete("test_edit", files)[0] == "tests/agent/test_edit_file.py"
    assert score("zzz", "agent/loop.py") is None
    assert complete("", files, limit=2) == sorted(files, key=len)[:2] or len(complete("", files, limit=2)) == 2


def test_mentions_attach_files_in_read_file_format(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "app.py").write_text("print('hi')\n")
    text = "look at @src/app.py and @missing.py, mail me@example.com"
    assert mentioned_paths(text) == ["src/app.py", "missing.py"]
    out, attached = expand(text, ToolContext.for_root(tmp_path))
    assert attached == ["src/app.py"]
    assert out.startswith(text) and '<file path="src/app.py">\n     1\tprint(\'hi\')\n</file>' in out
    out, attached = expand("see @../etc/passwd", ToolContext.for_root(tmp_path))
    assert attached == [] and out == "see @../etc/passwd"


def test_slash_commands_and_undo_through_the_controller(tmp_path):
    (tmp_path / "f.txt").write_text("before\n")
    turns = [{"tool_calls": [{"name": "edit_file", "arguments": {"path": "f.txt", "old_string": "before",
                                                                 "new_string": "after"}}]},
             {"content": "edited"}, {"content": "ok"}]
    events = []
    ui = Interactive(Config(), tmp_path, emit=events.append, model=DeterministicModel(turns))
    assert {c.name for c in COMMANDS} >= {"/help", "/clear", "/model", "/resume", "/index", "/compact", "/undo",
                                          "/exit"}
    assert "/undo" in help_text()
    fin = ui.run_turn("change @f.txt")
    assert fin.status == "completed" and (tmp_path / "f.txt").read_text() == "after\n"
    assert "before" in ui.rt.agent.messages[1]["content"]  # the mention was attached
    out = ui.command("/undo")
    assert out.text == "Restored: f.txt" and (tmp_path / "f.txt").read_text() == "before\n"
    again = ui.command("/undo")
    assert again.error and "already undone" in again.text and "no turn has run" not in again.text
    ui.run_turn("what now?")
    assert ui.rt.agent.messages[-2]["content"].startswith("(The user undid the file changes")
    assert ui.command("/model").text.startswith("Model: scripted")
    assert ui.command("/nope").error
    assert ui.command("/exit").exit
    sid = ui.rt.session.id
    assert ui.command("/clear").clear and ui.rt.session.id != sid
    assert sid in ui.command("/resume").text
    out = ui.command(f"/resume {sid}")
    assert out.clear and [m["role"] for m in out.replay][:2] == ["user", "assistant"]
    ui.close()
