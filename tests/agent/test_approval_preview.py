"""The approval question shows the change the call will make: the same diff, with the same context
lines and hunk headers, that the tool card shows once the call has run (one renderer for both)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent.approval import Approvals, Decision
from agent.protocol import ToolCallFinished
from agent.render import Preview, detail_lines
from agent.tools import Executor, ToolCall, ToolContext, default_registry

LINES = "".join(f"line {i}\n" for i in range(1, 13))


class Asked:
    """An `ask` callback that says yes and keeps what it was shown."""

    def __init__(self) -> None:
        self.previews: list[Preview] = []

    def __call__(self, call: Any, tool: Any, args: dict[str, Any], preview: Preview) -> Decision:
        self.previews.append(preview)
        return Decision("yes")


def run_call(root: Path, name: str, **args: Any) -> tuple[Preview, list[tuple[str, str]]]:
    """Run one call in ask mode; (what the question showed, what the finished card shows)."""
    asked = Asked()
    approvals = Approvals("ask", asked)
    ctx = ToolContext.for_root(root)
    approvals.ctx = ctx
    result = Executor(default_registry(), ctx, approve=approvals).run(
        [ToolCall("c1", name, json.dumps(args))]
    )[0]
    assert result.ok, result.content
    card = detail_lines(ToolCallFinished(1, 0, "c1", name, True, result.content, 0.1, result.data))
    (preview,) = asked.previews
    return preview, card


def test_an_edit_in_the_middle_of_a_file_shows_context_and_real_line_numbers(tmp_path):
    (tmp_path / "f.txt").write_text(LINES)
    preview, card = run_call(
        tmp_path, "edit_file", path="f.txt", old_string="line 7", new_string="line seven"
    )
    assert preview.question == "Edit f.txt?"
    assert preview.lines == card
    assert ("hunk", "@@ -4,7 +4,7 @@") in preview.lines  # not "@@ -1 +1 @@": numbered against the file
    assert ("context", " line 6") in preview.lines and ("context", " line 8") in preview.lines
    assert (tmp_path / "f.txt").read_text() == LINES.replace("line 7", "line seven")


def test_a_tolerant_match_and_replace_all_preview_what_the_tool_will_write(tmp_path):
    (tmp_path / "g.py").write_text(
        "def f():\n    x = 1\n    return x\n\n\ndef g():\n    y = 1\n    return y\n"
    )
    preview, card = run_call(tmp_path, "edit_file", path="g.py", old_string="y = 1   ", new_string="y = 2")
    assert preview.lines == card
    assert [ln for kind, ln in preview.lines if kind == "add"] == [
        "+    y = 2"
    ]  # the tool's re-indented text
    preview, card = run_call(
        tmp_path, "edit_file", path="g.py", old_string="return", new_string="yield", replace_all=True
    )
    assert preview.lines == card
    assert [ln for kind, ln in preview.lines if kind == "add"] == ["+    yield x", "+    yield y"]


def test_write_file_over_an_existing_file_shows_the_diff_not_the_whole_content(tmp_path):
    (tmp_path / "f.txt").write_text(LINES)
    preview, card = run_call(tmp_path, "write_file", path="f.txt", content=LINES.replace("line 3\n", ""))
    assert preview.question == "Overwrite f.txt (11 lines)?"
    assert preview.lines == card
    assert ("remove", "-line 3") in preview.lines and ("hunk", "@@ -1,6 +1,5 @@") in preview.lines

    preview, card = run_call(tmp_path, "write_file", path="new.txt", content="a\nb\n")
    assert preview.question == "Create new.txt (2 lines)?"
    assert preview.lines == card


def test_an_edit_that_will_fail_says_so_in_the_question(tmp_path):
    (tmp_path / "f.txt").write_text(LINES)
    approvals = Approvals("auto")
    approvals.ctx = ToolContext.for_root(tmp_path)
    preview = approvals.preview(
        "edit_file", {"path": "f.txt", "old_string": "no such text", "new_string": "x"}
    )
    assert preview.lines[0][0] == "error" and "no such text" not in LINES
    assert "will fail" in preview.lines[0][1]
