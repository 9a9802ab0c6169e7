"""Snapshots of the main screen states, as text, at a fixed terminal size.

The states are built from fixed event sequences (the same events the loop emits), with the spinner
and the clock frozen, so nothing in them depends on timing. A snapshot that differs fails the test
with the new screen; after an intended change, refresh them with COMPOSER_UPDATE_SNAPSHOTS=1.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agent.config import Config
from agent.interactive import Interactive
from agent.protocol import (
    AssistantMessage,
    Finished,
    ReasoningDelta,
    SessionStarted,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
    UsageReport,
)
from agent.scripted import DeterministicModel
from agent.tui.app import ComposerApp, PendingApproval

from .harness import SIZE, connected, screen_text, until

SNAPSHOTS = Path(__file__).parent / "snapshots"
DIFF = (
    "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
)
TODOS = [
    {"content": "find the bug", "status": "completed"},
    {"content": "fix add", "status": "in_progress"},
    {"content": "run the tests", "status": "pending"},
]


def check(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("COMPOSER_UPDATE_SNAPSHOTS"):
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    if not path.exists():
        pytest.fail(f"no snapshot {path.name}; create it with COMPOSER_UPDATE_SNAPSHOTS=1. Screen:\n{text}")
    assert text == path.read_text(), f"{name} changed; the screen is now:\n{text}"


def frozen_app(root: Path) -> ComposerApp:
    config = Config(approval="ask")
    return ComposerApp(
        lambda emit, ask: Interactive(config, root, emit=emit, ask=ask, model=DeterministicModel([])),
        root=root,
        approval="ask",
        clock=lambda: 1000.0,
        animate=False,
    )


async def feed(pilot, *events) -> None:
    for ev in events:
        pilot.app.pump(ev)
    await pilot.app.pump.flush()
    await pilot.pause()


def started(i: int, name: str, args: dict, turn: int = 1) -> ToolCallStarted:
    return ToolCallStarted(turn, i, f"c{turn}{i}", name, args)


def finished(i: int, name: str, ok: bool, content: str, data: dict, turn: int = 1, s: float = 0.4):
    return ToolCallFinished(turn, i, f"c{turn}{i}", name, ok, content, s, data)


async def session(pilot) -> None:
    await connected(pilot)
    await feed(
        pilot, SessionStarted("s1", "/repo", "qwen3-coder-30b", "http://127.0.0.1:8000/v1", "h", 32768)
    )


def test_snapshot_welcome(tmp_path):
    async def body():
        app = frozen_app(tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await session(pilot)
            check("welcome", screen_text(app))

    asyncio.run(body())


def test_snapshot_parallel_calls_running(tmp_path):
    async def body():
        app = frozen_app(tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await session(pilot)
            app.transcript.add_user("why does test_calc fail?")
            await feed(
                pilot,
                ReasoningDelta(1, "The test asserts add(2, 3) == 5.\nLook at calc.py first."),
                TextDelta(1, "Let me look at the code and run the test, "),
                TextDelta(1, "in parallel."),
                AssistantMessage(1, "…"),
                started(0, "read_file", {"path": "calc.py"}),
                started(1, "shell", {"command": "pytest -q"}),
                started(2, "grep", {"pattern": "def add", "output_mode": "content"}),
                finished(
                    0,
                    "read_file",
                    True,
                    "     1\tdef add(a, b):",
                    {"path": "calc.py", "start_line": 1, "end_line": 2, "total_lines": 2},
                ),
                finished(
                    2,
                    "grep",
                    True,
                    "…",
                    {
                        "mode": "content",
                        "files": 1,
                        "matches": 1,
                        "hits": [{"path": "calc.py", "line": 1, "text": "def add"}],
                    },
                ),
            )
            check("parallel_calls_running", screen_text(app))

    asyncio.run(body())


def test_snapshot_finished_turn_with_diff_shell_output_and_todos(tmp_path):
    async def body():
        app = frozen_app(tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await session(pilot)
            app.transcript.add_user("fix add and check")
            await feed(
                pilot,
                started(0, "todo_write", {"todos": TODOS}),
                finished(0, "todo_write", True, "…", {"todos": TODOS}),
                started(0, "edit_file", {"path": "calc.py"}, turn=2),
                finished(0, "edit_file", True, "Edited calc.py", {"path": "calc.py", "diff": DIFF}, turn=2),
                started(0, "shell", {"command": "python -m pytest -q"}, turn=3),
                finished(
                    0,
                    "shell",
                    False,
                    "F\nFAILED test_calc.py::test_neg\n1 failed\n[exit code 1; 0.6 s]",
                    {"command": "python -m pytest -q", "exit_code": 1},
                    turn=3,
                    s=0.6,
                ),
                TextDelta(4, "Fixed `add`; one test still fails:\n\n```\nFAILED test_calc.py::test_neg\n```"),
                AssistantMessage(4, "…"),
                UsageReport(4, 2900, 120, 9000, 400, 32768, 0.05, 181.6),
                Finished("completed", "…", 4, 3.2, 9000, 400, "s1"),
            )
            for card in app.transcript.cards.values():
                if card.tool in ("edit_file", "shell"):
                    card.expanded = True
            await pilot.pause()
            check("finished_turn", screen_text(app))

    asyncio.run(body())


def test_snapshot_approval_question_and_completion_menu(tmp_path):
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (tmp_path / "cache.md").write_text("y\n")

    async def body():
        app = frozen_app(tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await session(pilot)
            app.transcript.add_user("fix add")
            args = {"path": "calc.py", "old_string": "    return a - b\n", "new_string": "    return a + b\n"}
            await feed(pilot, started(0, "edit_file", args))
            preview = app.controller.approvals.preview("edit_file", args)  # the diff against calc.py as it is
            await app._show_approval(PendingApproval("c10", "edit_file", args, preview))
            await pilot.pause()
            check("approval", screen_text(app))
            app._resolve(app.pending.decision)
            app.prompt.focus()
            await pilot.press(*"see @ca")
            await until(pilot, lambda: app.query_one("#completions").display, "the menu")
            check("completion", screen_text(app))

    asyncio.run(body())
