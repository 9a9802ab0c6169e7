"""The TUI driven with Textual's Pilot against a scripted OpenAI-compatible server on loopback.

Everything under the widgets is real: the controller, the loop, the tools on a temporary repository,
HTTP streaming. Waits poll the app's state (never fixed sleeps) so the tests stay quick and stable.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from textual import events

from agent import history
from agent.completion import suggest
from agent.scripted import ScriptedServer
from agent.tui.answer import AssistantText
from agent.tui.approval import ApprovalBar
from agent.tui.panels import StatusBar, TodoPanel
from agent.tui.prompt import CompletionMenu

from ...conftest import git
from .harness import SIZE, card_states, connected, make_app, screen_text, send, shows, until


@pytest.fixture
def repo(git_repo: Path) -> Path:
    (git_repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (git_repo / "notes.md").write_text("# notes\n")
    git(git_repo, "add", "-A")
    git(git_repo, "commit", "-qm", "init")
    return git_repo


def body_text(card) -> str:
    return str(card.query_one("#body").render())


def test_a_task_streams_markdown_and_parallel_cards_run_side_by_side(repo):
    script = [
        {
            "content": "Checking **three** things at once.\n",
            "tool_calls": [
                {"name": "shell", "arguments": {"command": f"sleep 0.8; echo out{i}"}} for i in range(3)
            ]
            + [{"name": "grep", "arguments": {"pattern": "return", "output_mode": "content"}}],
        },
        {"content": "All good:\n\n- `out0`, `out1`, `out2`\n", "delay_s": 0.01},  # paced: tok/s needs >1 ms
    ]

    async def body():
        with ScriptedServer(script) as srv:
            app = make_app(repo, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                await send(pilot, "run the checks")
                # All three shell cards are on screen and spinning at the same moment.
                await until(pilot, lambda: card_states(app).count("running") >= 3, "three running cards")
                await until(pilot, lambda: not app.busy and "All good" in screen_text(app), "the answer")
                assert card_states(app) == ["ok"] * 4
                await shows(
                    pilot,
                    "Checking three things at once.",
                    "• out0, out1, out2",
                    "✓ shell  sleep 0.8; echo out0  exit 0",
                    "✓ grep  'return'  1 matching line in 1 file",
                )
                cards = list(app.transcript.cards.values())
                assert all(not c.expanded for c in cards)  # collapsed to one line when done
                cards[1].focus()
                await pilot.press("enter")
                assert cards[1].expanded
                assert body_text(cards[1]).splitlines() == ["$ sleep 0.8; echo out1", "out1", "exit code 0"]
                await pilot.click(cards[3])
                assert body_text(cards[3]) == "calc.py:2: return a - b"
                status = str(app.query_one("#status").render())
                assert status.startswith("scripted-model · ctx ") and "/32.8k" in status and "tok/s" in status
                assert "approval: auto" in status
                assert len(app.query(AssistantText)) == 2

    asyncio.run(body())


def test_ask_mode_approves_once_denies_with_a_reason_and_always(repo):
    script = [
        {"tool_calls": [{"name": "shell", "arguments": {"command": "echo yes > approved.txt"}}]},
        {"tool_calls": [{"name": "shell", "arguments": {"command": "echo no > denied.txt"}}]},
        {
            "tool_calls": [
                {"name": "shell", "arguments": {"command": f"touch always{i}.txt"}} for i in range(2)
            ]
        },
        {"content": "Finished."},
    ]

    async def body():
        with ScriptedServer(script) as srv:
            app = make_app(repo, srv.base_url, approval="ask")
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                bar = app.query_one(ApprovalBar)
                await send(pilot, "make files")
                await until(pilot, lambda: bar.display and app.pending, "the first question")
                assert card_states(app) == ["asking"], screen_text(app)
                await shows(pilot, "Run this command?", "$ echo yes > approved.txt")
                await pilot.press("y")
                await until(pilot, lambda: (repo / "approved.txt").exists(), "the approved command to run")

                await until(
                    pilot, lambda: app.pending and "denied" in app.pending.args["command"], "question 2"
                )
                await pilot.press("n")
                await pilot.press(*"use python instead", "enter")
                await until(
                    pilot, lambda: app.pending and "always" in app.pending.args["command"], "question 3"
                )
                await pilot.press("a")  # the second call of the turn runs without asking again
                await until(pilot, lambda: not app.busy and "Finished." in screen_text(app), "the end")
                assert not (repo / "denied.txt").exists()
                assert (repo / "always0.txt").exists() and (repo / "always1.txt").exists()
                assert not bar.display and app.focused is app.prompt
                denied = list(app.transcript.cards.values())[1]
                assert denied.state == "failed"
                await shows(pilot, "declined")
                told = srv.chat_requests()[2]["messages"][-1]
                assert told["role"] == "tool" and "declined" in told["content"]
                assert "use python instead" in told["content"]

    asyncio.run(body())


def test_an_edit_shows_a_coloured_diff_and_undo_restores_the_file(repo):
    script = [
        {
            "tool_calls": [
                {
                    "name": "edit_file",
                    "arguments": {
                        "path": "calc.py",
                        "old_string": "return a - b",
                        "new_string": "return a + b",
                    },
                }
            ]
        },
        {"content": "Fixed."},
    ]

    async def body():
        with ScriptedServer(script) as srv:
            app = make_app(repo, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                await send(pilot, "fix add")
                await until(pilot, lambda: not app.busy and "Fixed." in screen_text(app), "the edit")
                assert (repo / "calc.py").read_text().endswith("return a + b\n")
                card = next(iter(app.transcript.cards.values()))
                await shows(pilot, "✓ edit_file  calc.py  +1 −1")
                await pilot.click(card)
                rendered = card.query_one("#body").render()
                lines = str(rendered).splitlines()
                assert lines[:3] == ["--- a/calc.py", "+++ b/calc.py", "@@ -1,2 +1,2 @@"]
                colour = {str(rendered)[s.start : s.end]: str(s.style) for s in rendered.spans}
                assert "red" in colour["-    return a - b"] and "green" in colour["+    return a + b"]
                await shows(pilot, "-    return a - b")

                await send(pilot, "/undo")
                await until(pilot, lambda: "Restored: calc.py" in screen_text(app), "the undo notice")
                assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a - b\n"
                assert git(repo, "status", "--porcelain") == ""

    asyncio.run(body())


def test_escape_interrupts_a_slow_stream_and_a_running_command(repo):
    long = " ".join(f"word{i}" for i in range(400))
    script = [
        {"content": long, "delay_s": 0.02},
        {"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 30"}}]},
        {"content": "Still here."},
    ]

    async def body():
        with ScriptedServer(script) as srv:
            app = make_app(repo, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                await send(pilot, "talk")
                await until(pilot, lambda: "word5 " in screen_text(app), "the stream to start")
                await pilot.press("escape")
                await until(
                    pilot, lambda: not app.busy and "Interrupted." in screen_text(app), "the interrupt"
                )
                assert "word399" not in screen_text(app)

                await send(pilot, "run it")
                await until(pilot, lambda: card_states(app) == ["running"], "the command to start")
                await pilot.pause(0.3)
                await pilot.press("escape")
                await until(pilot, lambda: not app.busy, "the command to be killed", timeout=5)
                await shows(pilot, "interrupted")

                await send(pilot, "go on")  # the session is consistent: the next turn just works
                await until(pilot, lambda: "Still here." in screen_text(app), "the next answer")
                last = srv.chat_requests()[-1]["messages"]
                assert [m["role"] for m in last[-4:]] == ["assistant", "tool", "assistant", "user"] or last[
                    -1
                ] == {"role": "user", "content": "go on"}

    asyncio.run(body())


def test_history_completion_multiline_and_todos(repo):
    history.append(history.history_path(repo), "an older task")
    history.append(history.history_path(repo), "the last task\nwith two lines")
    script = [
        {
            "tool_calls": [
                {
                    "name": "todo_write",
                    "arguments": {
                        "todos": [
                            {"content": "read calc.py", "status": "completed"},
                            {"content": "fix add", "status": "in_progress"},
                            {"content": "run tests", "status": "pending"},
                        ]
                    },
                }
            ]
        },
        {"content": "Planned."},
    ]

    async def body():
        with ScriptedServer(script) as srv:
            app = make_app(repo, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                prompt, menu = app.prompt, app.query_one(CompletionMenu)
                await pilot.press("up")
                assert prompt.text == "the last task\nwith two lines"
                await pilot.press("up")  # the cursor is on the last line of the entry: ↑ moves within it
                await pilot.press("up")
                assert prompt.text == "an older task"
                await pilot.press("down")
                assert prompt.text == "the last task\nwith two lines"
                await pilot.press("down")  # back to the (empty) draft
                assert prompt.text == ""

                await pilot.press(*"look at @cal")
                await until(pilot, lambda: menu.display, "the completion menu")
                assert menu.suggestions[0].label == "calc.py"
                await pilot.press("tab")
                assert prompt.text == "look at @calc.py " and not menu.display
                await pilot.press("ctrl+j", *"and plan")
                assert prompt.text == "look at @calc.py \nand plan"
                await pilot.press("enter")
                await until(pilot, lambda: not app.busy and "Planned." in screen_text(app), "the answer")
                sent = srv.chat_requests()[0]["messages"][-1]["content"]
                assert sent.startswith("look at @calc.py \nand plan") and "return a - b" in sent  # attached
                todos = app.query_one(TodoPanel)
                assert todos.display
                await shows(pilot, "Todos 1/3", "▸ fix add")
                assert history.load(history.history_path(repo))[-1] == "look at @calc.py \nand plan"

                await pilot.press("/", "u", "n")
                await until(pilot, lambda: menu.display and menu.suggestions[0].label == "/undo", "commands")
                await pilot.press("enter")  # accepts the completion, does not send yet
                assert prompt.text == "/undo" and not menu.display

                # Keys typed faster than the menu follows (the issue: `/undo` + Enter gave `/u/undo`): the
                # menu still offers /un's completions, for a 3-character token, when Enter arrives after
                # "/undo" was typed in full. Enter then sends /undo; it pastes nothing over it.
                prompt.set_text("")
                await pilot.pause()
                prompt.insert("/undo")
                await pilot.pause()
                menu.show(3, suggest("/un", list)[1])
                await pilot.press("enter")
                assert prompt.text == "" and history.load(history.history_path(repo))[-1] == "/undo"

    asyncio.run(body())


def test_clear_starts_over_and_resume_shows_the_saved_conversation(repo):
    script = [{"content": "The answer is **42**."}, {"content": "Fresh start."}]

    async def body():
        with ScriptedServer(script) as srv:
            app = make_app(repo, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                first = app.controller.rt.session.id
                await send(pilot, "what is the answer?")
                await until(pilot, lambda: not app.busy and "The answer is 42." in screen_text(app), "answer")
                await send(pilot, "/clear")
                await until(pilot, lambda: "New session" in screen_text(app), "the clear")
                assert "The answer is 42." not in screen_text(app) and app.controller.rt.session.id != first
                await send(pilot, "hello again")
                await until(pilot, lambda: "Fresh start." in screen_text(app), "the new session's answer")
            app = make_app(repo, srv.base_url, resume=first)
            async with app.run_test(size=SIZE) as pilot:
                await until(
                    pilot, lambda: f"Resumed session {first}" in screen_text(app), "the resumed session"
                )
                screen = await shows(pilot, "what is the answer?", "The answer is 42.")
                assert "hello again" not in screen

    asyncio.run(body())


def test_ctrl_c_clears_then_quits_and_ctrl_d_quits_on_an_empty_prompt(tmp_path):
    async def body():
        with ScriptedServer([]) as srv:
            app = make_app(tmp_path, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                await pilot.press(*"draft", "ctrl+d")  # with text, Ctrl+D deletes forward, as in editors
                assert app.is_running and app.prompt.text == "draft"
                await pilot.press("ctrl+c")
                assert app.prompt.text == "" and app.is_running
                await pilot.press("ctrl+c", "ctrl+c")
                await until(pilot, lambda: app.return_code == 0, "Ctrl+C twice to quit")
            app = make_app(tmp_path, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                await pilot.press("ctrl+d")
                await until(pilot, lambda: app.return_code == 0, "Ctrl+D to quit")

    asyncio.run(body())


def test_an_unreachable_server_is_reported_and_the_app_stays_usable(tmp_path):
    async def body():
        app = make_app(tmp_path, "http://127.0.0.1:9/v1")
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: "Cannot start the session" in screen_text(app), "the connection error")
            assert app.connect_error and "not connected" in str(app.query_one("#status").render())
            await send(pilot, "/help")
            await until(pilot, lambda: "/undo" in screen_text(app), "help without a server")
            await send(pilot, "/exit")
            await until(pilot, lambda: app.return_code == 0, "exit")

    asyncio.run(body())


def test_a_message_sent_during_a_turn_is_queued_then_sent(repo):
    slow = " ".join(f"word{i}" for i in range(300))
    script = [
        {"content": slow, "delay_s": 0.02},
        {"content": "Got both."},
        {"content": " ".join(f"more{i}" for i in range(300)), "delay_s": 0.02},
        {"content": "unused"},
    ]

    async def body():
        with ScriptedServer(script) as srv:
            app = make_app(repo, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                await send(pilot, "first")
                await until(pilot, lambda: "word5 " in screen_text(app), "the stream to start")
                await send(pilot, "and also this")
                await shows(pilot, "Queued")
                assert len(srv.chat_requests()) == 1  # not sent yet: the turn is still running
                await until(
                    pilot, lambda: "Got both." in screen_text(app), "the queued message's answer", timeout=15
                )
                assert srv.chat_requests()[1]["messages"][-1] == {"role": "user", "content": "and also this"}

                # Esc ends the turn and puts what was queued back in the input box, unsent.
                await send(pilot, "third")
                await until(pilot, lambda: "more5 " in screen_text(app), "the third stream")
                await send(pilot, "never sent")
                await until(pilot, lambda: app.queued == ["never sent"], "the message to be queued")
                await pilot.press("escape")
                await until(pilot, lambda: not app.busy, "the interrupt")
                assert app.prompt.text == "never sent"
                assert len(srv.chat_requests()) == 3

    asyncio.run(body())


def test_typing_on_a_focused_card_goes_to_the_prompt_and_enter_sends(repo):
    """Tab + Enter expands a card; what is typed next, Enter included, belongs to the input box.

    The keys are posted as the terminal driver posts them, all at once (a fast typist, a paste, or
    tmux send-keys): a focus moved only after the first key left the rest, Enter too, on the card."""
    script = [{"tool_calls": [{"name": "shell", "arguments": {"command": "echo hi"}}]}, {"content": "Done."}]

    async def body():
        with ScriptedServer(script) as srv:
            app = make_app(repo, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                await send(pilot, "go")
                await until(pilot, lambda: not app.busy and "Done." in screen_text(app), "the answer")
                card = next(iter(app.transcript.cards.values()))
                for _ in range(3):
                    if app.focused is card:
                        break
                    await pilot.press("tab")
                assert app.focused is card
                await pilot.press("enter")
                assert card.expanded
                for key in "/help":
                    app.post_message(events.Key(key, key))
                app.post_message(events.Key("enter", "\r"))
                await until(
                    pilot, lambda: "Commands:" in screen_text(app), "/help sent by one Enter", timeout=5
                )
                assert app.prompt.text == "" and app.focused is app.prompt
                assert card.expanded  # the Enter was not taken by the card

                card.focus()
                await pilot.press("space")  # keys a card uses still work on it
                assert not card.expanded
                await pilot.press(*"/undo", "enter")  # typed at human speed
                await shows(pilot, "The last turn changed no files.", timeout=5)
                assert app.prompt.text == ""

    asyncio.run(body())


def test_the_built_in_model_is_named_on_screen_and_its_claims_marked_unverified(repo):
    """The start-up line composer-agent prints before the screen takes over is never seen in the app: the
    banner, the status bar and the end of each answer say it instead."""
    async def body():
        with ScriptedServer([{"content": "Fixed it; the tests pass."}]) as srv:
            app = make_app(repo, srv.base_url, builtin=True)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                await shows(pilot, "small built-in model", "toy")
                assert "built-in toy model" in str(app.query_one(StatusBar).render())
                await send(pilot, "fix the test")
                await until(pilot, lambda: not app.busy and "unverified" in screen_text(app), "the label")

    asyncio.run(body())


def test_shift_tab_cycles_the_mode_and_ask_mode_writes_nothing(repo):
    """Shift+Tab: code → ask → plan → code, through the controller's /mode (the loop's policy)."""
    script = [{"tool_calls": [{"name": "write_file", "arguments": {"path": "new.txt", "content": "x"}}]},
              {"content": "I may not write here."}]

    async def body():
        with ScriptedServer(script) as srv:
            app = make_app(repo, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                seen = []
                for _ in range(3):
                    await pilot.press("shift+tab")
                    seen.append(app.controller.mode)
                assert seen == ["ask", "plan", "code"]
                await pilot.press("shift+tab")
                await send(pilot, "write a file")
                await until(pilot, lambda: not app.busy and "I may not write" in screen_text(app), "the answer")
                assert not (repo / "new.txt").exists()

    asyncio.run(body())


def test_a_plan_mode_turn_ending_with_a_plan_asks_to_carry_it_out_and_yes_switches_to_code(repo):
    """Plan mode: the turn ends with a todo list, the bar asks (y/n only: 'a' does nothing), y switches to
    code mode and the plan is carried out in a turn that may now edit."""
    script = [
        {"tool_calls": [{"name": "todo_write", "arguments": {"todos": [{"content": "fix add", "status": "pending"}]}}]},
        {"content": "Plan: fix add."},
        {"tool_calls": [{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "a - b",
                                                            "new_string": "a + b"}}]},
        {"content": "Carried out."},
    ]

    async def body():
        with ScriptedServer(script) as srv:
            app = make_app(repo, srv.base_url)
            async with app.run_test(size=SIZE) as pilot:
                await connected(pilot)
                app.controller.command("/mode plan")
                await send(pilot, "plan the fix")
                bar = app.query_one(ApprovalBar)
                await until(pilot, lambda: bar.display and app.pending is not None, "the plan question")
                await shows(pilot, "Carry out this plan in code mode?", "• fix add", "[n] no, keep planning")
                assert app.controller.mode == "plan" and (repo / "calc.py").read_text().endswith("a - b\n")
                await pilot.press("a")  # not an answer to this question
                assert app.pending is not None
                await pilot.press("y")
                await until(pilot, lambda: not app.busy and "Carried out" in screen_text(app), "the plan carried out")
                assert app.controller.mode == "code" and app.controller.rt.agent.mode == "code"
                assert (repo / "calc.py").read_text().endswith("a + b\n")
                assert not bar.display

    asyncio.run(body())
