"""Modes (ask / plan / code) are the loop's tool policy: in ask and plan a model that tries every way to
write changes nothing, in every front-end and under every approval mode. (The ACP server's modes are
in test_acp.py.)"""

from __future__ import annotations

from agent.approval import Approvals
from agent.config import Config
from agent.interactive import Interactive
from agent.scripted import DeterministicModel, ScriptedServer

from .test_headless import run_agent

TRIES = {"tool_calls": [
    {"name": "write_file", "arguments": {"path": "new.txt", "content": "x"}},
    {"name": "edit_file", "arguments": {"path": "f.txt", "old_string": "before", "new_string": "after"}},
    {"name": "edit_file", "arguments": {"path": "made.txt", "old_string": "", "new_string": "x"}},
    {"name": "shell", "arguments": {"command": "echo hi > shell.txt"}},
]}


def untouched(root) -> bool:
    return (root / "f.txt").read_text() == "before\n" and sorted(p.name for p in root.iterdir()) == [
        ".composer", "f.txt"]


def test_mode_command_refuses_writes_keeps_the_mode_across_clear_and_carries_out_an_accepted_plan(tmp_path):
    (tmp_path / "f.txt").write_text("before\n")
    asked = []

    def ask(*a):  # never reached: the mode refuses before any question
        asked.append(a)
        raise AssertionError("asked in a read-only mode")

    plan = {"tool_calls": [{"name": "todo_write", "arguments": {"todos": [{"content": "edit f", "status": "pending"}]}}]}
    turns = [TRIES, {"content": "f says before"}, TRIES, plan, {"content": "Plan ready."},
             TRIES, {"content": "done"}]
    events = []
    ui = Interactive(Config(approval="auto"), tmp_path, emit=events.append, model=DeterministicModel(turns), ask=ask,
                     mode="ask")
    assert ui.command("/mode").text.startswith("Mode: ask")
    fin = ui.run_turn("what does f say?")
    assert fin.status == "completed" and untouched(tmp_path)
    results = [m["content"] for m in ui.rt.agent.messages if m["role"] == "tool"]
    assert len(results) == 4 and all("ask mode" in r for r in results)
    assert ui.command("/mode nonsense").error
    ui.command("/clear")  # a new session, the same mode
    assert ui.rt.agent.mode == "ask"
    assert ui.command("/mode plan").text == "Mode: plan."
    fin = ui.run_turn("plan it")
    assert untouched(tmp_path) and ui.plan_ready(fin) == [{"content": "edit f", "status": "pending"}]
    fin = ui.accept_plan()  # the user accepts: code mode, and the plan is carried out
    assert fin.status == "completed" and ui.mode == ui.rt.agent.mode == "code"
    assert (tmp_path / "f.txt").read_text() == "after\n" and (tmp_path / "shell.txt").exists()
    assert [e.mode for e in events if e.type == "mode_changed"] == ["ask", "ask", "plan", "code"]
    assert not asked
    ui.close()


def test_approvals_never_see_a_call_the_mode_refuses(tmp_path):
    """Even `ask` approval (a person who would say yes) is not consulted: the mode decides first."""
    (tmp_path / "f.txt").write_text("before\n")
    said_yes = []

    def yes(call, tool, args, preview):
        said_yes.append(tool.name)
        from agent.approval import Decision

        return Decision("yes")

    ui = Interactive(Config(approval="ask"), tmp_path, emit=lambda e: None,
                     model=DeterministicModel([TRIES, {"content": "ok"}]), ask=yes, mode="plan")
    assert isinstance(ui.approvals, Approvals)
    ui.run_turn("try")
    assert untouched(tmp_path) and said_yes == []
    ui.close()


def test_headless_mode_flag_writes_nothing_even_with_approval_auto(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "f.txt").write_text("before\n")
    with ScriptedServer([TRIES, {"content": "f says before"}]) as srv:
        proc = run_agent(repo, "--task", "what does f say?", "--mode", "ask", "--approval", "auto",
                         "--base-url", srv.base_url)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "f says before"
    assert proc.stderr.splitlines()[0].startswith("composer-agent: ask mode: it may read")
    assert untouched(repo)


def test_the_mode_is_saved_with_the_session_and_a_resumed_session_starts_in_it(tmp_path):
    """The session file records each change of mode; line mode's --resume (without --mode) goes on in
    the last one recorded, so a model that tries to write in the resumed session changes nothing."""
    import os
    import subprocess

    from agent.session import find_session, load

    from .test_headless import agent_cmd

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "f.txt").write_text("before\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSER_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")

    def line_mode(srv, *args, said):  # stdin piped: line mode, one message a line
        return subprocess.run(agent_cmd("--cwd", str(repo), "--base-url", srv.base_url, "--approval", "auto", *args),
                              input=said, capture_output=True, text=True, env=env, timeout=60)

    with ScriptedServer([{"content": "noted"}, TRIES, {"content": "f says before"}]) as srv:
        first = line_mode(srv, "--mode", "plan", said="hello\n/mode ask\n")
        assert first.returncode == 0, first.stderr
        (path,) = (repo / ".composer" / "sessions").glob("*.jsonl")
        assert [r["mode"] for r in load(path).records if r["type"] == "mode"] == ["plan", "ask"]
        second = line_mode(srv, "--resume", path.stem, said="write f\n")
        assert second.returncode == 0, second.stderr
        told = [m["content"] for m in srv.chat_requests()[2]["messages"] if m["role"] == "tool"]
    assert untouched(repo) and len(told) == 4 and all("ask mode" in t for t in told)
    assert load(find_session(repo / ".composer" / "sessions", path.stem)).mode == "ask"
