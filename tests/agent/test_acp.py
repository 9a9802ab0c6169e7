"""`composer-agent acp` driven by the official ACP SDK's client side, as an editor drives it: a subprocess
on stdio, a scripted OpenAI-compatible model on loopback, nothing of ours mocked.

Each test fails when the method it names breaks: initialize, session/new, session/prompt with its
updates, session/request_permission both ways, session/cancel, session/set_mode, session/load; and
the errors a client can provoke. Latencies are measured and printed (run with -s); their assertions
are generous bounds, not the goals (cancel 0.5 s, first update 0.3 s), so a loaded machine does not
make them flaky.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

acp = pytest.importorskip("acp")  # the `acp` extra (in `dev`)

from acp import PROTOCOL_VERSION, RequestError, spawn_agent_process, text_block  # noqa: E402
from acp.schema import AllowedOutcome, ClientCapabilities, RequestPermissionResponse  # noqa: E402

from agent.scripted import ScriptedServer  # noqa: E402
from agent.session import find_session, load  # noqa: E402

from .test_headless import agent_cmd  # noqa: E402


class Editor:
    """An ACP client: records every update, answers permission requests from a list of option ids."""

    def __init__(self, answers: list[str] | None = None, reason: str = ""):
        self.answers = list(answers or [])
        self.reason = reason
        self.updates: list[tuple[float, Any]] = []
        self.asks: list[Any] = []
        self.first_update = asyncio.Event()

    async def session_update(self, session_id: str, update: Any, **kw: Any) -> None:
        self.updates.append((time.perf_counter(), update))
        self.first_update.set()

    async def request_permission(self, session_id: str, tool_call: Any, options: list[Any], **kw: Any):
        self.asks.append((tool_call, [o.option_id for o in options]))
        choice = self.answers.pop(0) if self.answers else "reject"
        meta = {"reason": self.reason} if choice == "reject" and self.reason else None
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id=choice),
                                         field_meta=meta)

    def of(self, kind: str) -> list[Any]:
        return [u for _, u in self.updates if u.session_update == kind]

    def text(self) -> str:
        return "".join(u.content.text for u in self.of("agent_message_chunk"))


def env_for(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSER_")}
    return {**env, "XDG_CONFIG_HOME": str(repo.parent / "xdg")}


async def session(editor: Editor, repo: Path, srv: ScriptedServer, *flags: str):
    """An async context: (connection, process, session id) of a fresh `composer-agent acp`."""
    cmd = agent_cmd("acp", "--base-url", srv.base_url, *flags)
    ctx = spawn_agent_process(editor, cmd[0], *cmd[1:], env=env_for(repo), cwd=str(repo))
    conn, proc = await ctx.__aenter__()
    init = await conn.initialize(protocol_version=PROTOCOL_VERSION, client_capabilities=ClientCapabilities())
    assert init.protocol_version == PROTOCOL_VERSION and init.agent_capabilities.load_session
    new = await conn.new_session(cwd=str(repo), mcp_servers=[])
    assert new.modes.current_mode_id == "code" and {m.id for m in new.modes.available_modes} == {"code", "ask", "plan"}
    return ctx, conn, proc, new.session_id


def run(coro) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    (r / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (r / "notes.md").write_text("add is broken\n")
    return r


WHOLE = [
    {"content": "Reading both files.",
     "tool_calls": [{"name": "read_file", "arguments": {"path": "calc.py"}},
                    {"name": "read_file", "arguments": {"path": "notes.md"}},
                    {"name": "grep", "arguments": {"pattern": "def add"}}]},
    {"tool_calls": [{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "return a - b",
                                                        "new_string": "return a + b"}}]},
    {"tool_calls": [{"name": "shell", "arguments": {"command": "touch shell-ran"}}]},
    {"tool_calls": [{"name": "todo_write", "arguments": {"todos": [
        {"content": "fix add", "status": "completed"}, {"content": "add a test", "status": "pending"}]}}]},
    {"content": "Fixed add."},
]


def test_prompt_streams_tool_calls_diffs_plan_and_asks_permission_both_ways(repo):
    """session/prompt: chunks, parallel tool calls with kinds and locations, the edit's diff, the plan;
    session/request_permission: the edit allowed, the shell command rejected with a reason the model sees."""
    editor = Editor(answers=["allow", "reject"], reason="no shell today")

    async def go():
        with ScriptedServer(WHOLE) as srv:
            ctx, conn, proc, sid = await session(editor, repo, srv)
            try:
                t0 = time.perf_counter()
                resp = await conn.prompt(session_id=sid, prompt=[text_block("fix add")])
                first = editor.updates[0][0] - t0
            finally:
                await ctx.__aexit__(None, None, None)
            return resp, first, srv.chat_requests()

    resp, first, requests = run(go())
    print(f"\nfirst update {first * 1000:.1f} ms after the prompt")
    assert resp.stop_reason == "end_turn"
    assert first < 3.0  # goal 0.3 s; measured figures are printed, the bound only catches a hang
    assert editor.text() == "Reading both files.Fixed add."
    starts = {u.tool_call_id: u for u in editor.of("tool_call")}
    kinds = sorted((u.kind, u.title) for u in starts.values())
    assert kinds == [("edit", "Edit calc.py"), ("execute", "touch shell-ran"), ("read", "Read calc.py"),
                     ("read", "Read notes.md"), ("search", "grep def add"), ("think", "Update the plan")]
    read = next(u for u in starts.values() if u.title == "Read calc.py")
    assert read.locations[0].path == str(repo / "calc.py")
    # The three calls of turn 1 ran in parallel: all three started before the first finished.
    order = [(u.session_update, u.tool_call_id) for _, u in editor.updates if u.session_update.startswith("tool_call")]
    assert [k for k, _ in order[:3]] == ["tool_call"] * 3
    ends = {u.tool_call_id: u for u in editor.of("tool_call_update")}
    edit = next(i for i, u in starts.items() if u.kind == "edit")
    diff = ends[edit].content[0]
    assert (diff.type, diff.path, diff.old_text, diff.new_text) == (
        "diff", str(repo / "calc.py"), "def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n")
    assert (repo / "calc.py").read_text().endswith("a + b\n")
    # Asked twice (edit, shell), with allow once / always / reject; the shell was refused with the reason.
    assert [(tc.kind, opts) for tc, opts in editor.asks] == [("edit", ["allow", "always", "reject"]),
                                                            ("execute", ["allow", "always", "reject"])]
    shell = next(i for i, u in starts.items() if u.kind == "execute")
    assert ends[shell].status == "failed" and not (repo / "shell-ran").exists()
    told = [m["content"] for m in requests[3]["messages"] if m["role"] == "tool"][-1]
    assert "declined" in told and "no shell today" in told
    plan = editor.of("plan")[-1]
    assert [(e.content, e.status) for e in plan.entries] == [("fix add", "completed"), ("add a test", "pending")]


def test_cancel_stops_the_stream_and_the_command(repo):
    """session/cancel mid-stream (the model still writing) and mid-command (a shell sleeping): the prompt
    answers `cancelled` quickly each time, the command is killed, and the session is still usable."""
    slow = [{"content": "word " * 400, "delay_s": 0.02},
            {"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 30 && touch late"}}]},
            {"content": "still here"}]
    editor = Editor()

    async def go():
        with ScriptedServer(slow, chunk_chars=5) as srv:
            ctx, conn, proc, sid = await session(editor, repo, srv, "--approval", "auto")
            try:
                times = []
                for text in ("talk", "sleep"):
                    editor.first_update.clear()
                    task = asyncio.create_task(conn.prompt(session_id=sid, prompt=[text_block(text)]))
                    await editor.first_update.wait()
                    if text == "sleep":
                        while not editor.of("tool_call"):
                            await asyncio.sleep(0.01)
                        await asyncio.sleep(0.3)  # the command is running
                    t0 = time.perf_counter()
                    await conn.cancel(session_id=sid)
                    resp = await task
                    times.append((resp.stop_reason, time.perf_counter() - t0))
                after = await conn.prompt(session_id=sid, prompt=[text_block("again")])
            finally:
                await ctx.__aexit__(None, None, None)
            return times, after

    times, after = run(go())
    print(f"\ncancel → prompt answered: mid-stream {times[0][1] * 1000:.0f} ms, mid-command {times[1][1] * 1000:.0f} ms")
    assert [r for r, _ in times] == ["cancelled", "cancelled"]
    assert all(t < 3.0 for _, t in times)  # goal 0.5 s; the bound only catches a hang
    assert len(editor.text()) < len("word " * 400)  # the stream did stop
    assert after.stop_reason == "end_turn"
    time.sleep(0.2)
    assert not (repo / "late").exists()


WRITES = [{"tool_calls": [{"name": "write_file", "arguments": {"path": "new.txt", "content": "x"}},
                          {"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "a - b",
                                                              "new_string": "a + b"}},
                          {"name": "shell", "arguments": {"command": "echo hi > shell.txt"}}]}]


def test_ask_and_plan_modes_write_nothing_and_an_accepted_plan_switches_to_code(repo):
    """session/set_mode: in ask and in plan a model that tries write_file, edit_file and shell changes
    nothing (refused by the policy, no permission asked, even with --approval auto); a plan-mode turn
    ending with a todo list is offered to carry out, and accepting switches to code and runs it."""
    script = [
        *WRITES, {"content": "add subtracts."},                                     # ask
        *WRITES,                                                                    # plan
        {"tool_calls": [{"name": "todo_write", "arguments": {"todos": [{"content": "fix add", "status": "pending"}]}}]},
        {"content": "Plan: fix add."},
        {"tool_calls": [{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "a - b",
                                                            "new_string": "a + b"}}]},  # code, accepted
        {"content": "Done."},
    ]
    editor = Editor(answers=["allow"])
    before = (repo / "calc.py").read_text()

    async def go():
        with ScriptedServer(script) as srv:
            ctx, conn, proc, sid = await session(editor, repo, srv, "--approval", "auto")
            try:
                await conn.set_session_mode(session_id=sid, mode_id="ask")
                asked = await conn.prompt(session_id=sid, prompt=[text_block("why is add wrong?")])
                unchanged = (repo / "calc.py").read_text()
                await conn.set_session_mode(session_id=sid, mode_id="plan")
                planned = await conn.prompt(session_id=sid, prompt=[text_block("plan the fix")])
                with pytest.raises(RequestError):
                    await conn.set_session_mode(session_id=sid, mode_id="yolo")
            finally:
                await ctx.__aexit__(None, None, None)
            return asked, unchanged, planned, srv.chat_requests()

    asked, unchanged, planned, requests = run(go())
    assert asked.stop_reason == planned.stop_reason == "end_turn"
    assert unchanged == before and not (repo / "new.txt").exists() and not (repo / "shell.txt").exists()
    refusals = [u for u in editor.of("tool_call_update") if u.status == "failed"]
    assert len(refusals) == 6 and all("mode" in u.content[0].content.text for u in refusals)
    assert requests[0]["messages"][-1]["content"].startswith("(Ask mode")
    # The only question was the plan's (--approval auto asks nothing else); accepted, code mode edits.
    assert [(tc.kind, opts) for tc, opts in editor.asks] == [("switch_mode", ["allow", "reject"])]
    assert [u.current_mode_id for u in editor.of("current_mode_update")] == ["ask", "plan", "code"]
    assert (repo / "calc.py").read_text().endswith("a + b\n")


def test_load_resumes_a_saved_session_and_replays_it(repo):
    """session/load in a new process: the conversation is replayed as updates before the answer, the
    session is in the mode it was saved in, and the next prompt continues it (the model sees the
    earlier messages)."""
    script = [{"content": "The answer is 42."}, {"content": "As I said, 42."}]

    async def go():
        with ScriptedServer(script) as srv:
            first = Editor()
            ctx, conn, proc, sid = await session(first, repo, srv)
            try:
                await conn.prompt(session_id=sid, prompt=[text_block("what is the answer?")])
                await conn.set_session_mode(session_id=sid, mode_id="plan")  # saved with the session
            finally:
                await ctx.__aexit__(None, None, None)
            second = Editor()
            ctx, conn, proc, _ = await session(second, repo, srv)
            try:
                loaded = await conn.load_session(cwd=str(repo), session_id=sid, mcp_servers=[])
                replayed = list(second.updates)
                with pytest.raises(RequestError):
                    await conn.load_session(cwd=str(repo), session_id="no-such-session", mcp_servers=[])
                again = await conn.prompt(session_id=sid, prompt=[text_block("and again?")])
            finally:
                await ctx.__aexit__(None, None, None)
            return loaded, replayed, again, srv.chat_requests()

    loaded, replayed, again, requests = run(go())
    assert loaded.modes.current_mode_id == "plan"  # the mode it was saved in, and the loop is in it:
    assert requests[1]["messages"][-1]["content"].startswith("(Plan mode")
    said = [(u.session_update, u.content.text) for _, u in replayed]
    assert said == [("user_message_chunk", "what is the answer?"), ("agent_message_chunk", "The answer is 42.")]
    assert again.stop_reason == "end_turn"
    assert [m["content"] for m in requests[1]["messages"] if m["role"] != "system"][:-1] == [
        "what is the answer?", "The answer is 42."] and requests[1]["messages"][-1]["content"].endswith("and again?")


def test_bad_messages_get_errors_and_the_agent_keeps_serving(repo):
    """Not JSON, not an object, an unknown method, an unknown session id: each gets a JSON-RPC error
    and the next request is still answered; stdout holds nothing but JSON-RPC."""
    lines = ['garbage{', '[1, 2]',
             json.dumps({"jsonrpc": "2.0", "id": 1, "method": "no/such/method", "params": {}}),
             json.dumps({"jsonrpc": "2.0", "id": 2, "method": "session/prompt",
                         "params": {"sessionId": "nope", "prompt": [{"type": "text", "text": "hi"}]}}),
             json.dumps({"jsonrpc": "2.0", "id": 3, "method": "initialize", "params": {"protocolVersion": 1}})]
    with ScriptedServer([]) as srv:
        proc = subprocess.run(agent_cmd("acp", "--base-url", srv.base_url), input="\n".join(lines) + "\n",
                              capture_output=True, text=True, timeout=60, env=env_for(repo), cwd=repo)
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, proc.stderr
    errors = [(m["id"], m["error"]["code"]) for m in out if "error" in m]
    assert errors == [(None, -32700), (None, -32600), (1, -32601), (2, -32602)]
    assert [m["id"] for m in out if "result" in m] == [3]


def test_a_client_that_disappears_ends_the_command_and_saves_the_session(repo):
    """The editor dies mid-turn (stdin closes): the running command is killed, the agent exits, and the
    session file ends with the turn's `finished` record, so it can be loaded later."""
    script = [{"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 30 && touch late"}}]},
              {"content": "never"}]
    editor = Editor()

    async def go():
        with ScriptedServer(script) as srv:
            ctx, conn, proc, sid = await session(editor, repo, srv, "--approval", "auto")
            asyncio.create_task(conn.prompt(session_id=sid, prompt=[text_block("sleep")]))
            while not editor.of("tool_call"):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            proc.stdin.close()
            code = await asyncio.wait_for(proc.wait(), 20)
            gone = time.perf_counter() - t0
            try:
                await ctx.__aexit__(None, None, None)
            except Exception:  # noqa: BLE001 - the connection is closed under it
                pass
            return sid, code, gone

    sid, code, gone = run(go())
    print(f"\nclient gone → agent exited in {gone * 1000:.0f} ms")
    assert code == 0 and gone < 15
    records = load(find_session(repo / ".composer" / "sessions", sid)).records
    assert records[-1]["type"] == "finished" and records[-1]["status"] == "interrupted"
    time.sleep(0.2)
    assert not (repo / "late").exists()


class BufferEditor(Editor):
    """An editor with an unsaved buffer: fs/read_text_file serves it, fs/write_text_file keeps writes."""

    def __init__(self, buffers: dict[str, str]):
        super().__init__(answers=["always"])
        self.buffers = buffers
        self.reads: list[str] = []
        self.writes: list[tuple[str, str]] = []

    async def read_text_file(self, session_id: str, path: str, line: Any = None, limit: Any = None, **kw: Any):
        from acp.schema import ReadTextFileResponse

        self.reads.append(path)
        if path not in self.buffers:
            raise RequestError.resource_not_found(path)
        return ReadTextFileResponse(content=self.buffers[path])

    async def write_text_file(self, session_id: str, path: str, content: str, **kw: Any):
        self.writes.append((path, content))
        self.buffers[path] = content


def test_the_editors_unsaved_buffers_are_what_the_agent_reads_and_edits(repo):
    """fs/read_text_file and fs/write_text_file, offered by the client: read_file shows the unsaved buffer,
    edit_file edits it and writes it back through the editor (the disk is the editor's business)."""
    calc = str(repo / "calc.py")
    editor = BufferEditor({calc: "def add(a, b):\n    return a * b  # unsaved\n"})
    script = [{"tool_calls": [{"name": "read_file", "arguments": {"path": "calc.py"}}]},
              {"tool_calls": [{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "a * b",
                                                                  "new_string": "a + b"}}]},
              {"content": "Fixed the buffer."}]

    async def go():
        with ScriptedServer(script) as srv:
            cmd = agent_cmd("acp", "--base-url", srv.base_url)
            async with spawn_agent_process(editor, cmd[0], *cmd[1:], env=env_for(repo), cwd=str(repo)) as (conn, _):
                caps = ClientCapabilities(fs={"readTextFile": True, "writeTextFile": True})
                await conn.initialize(protocol_version=PROTOCOL_VERSION, client_capabilities=caps)
                sid = (await conn.new_session(cwd=str(repo), mcp_servers=[])).session_id
                resp = await conn.prompt(session_id=sid, prompt=[text_block("fix")])
            return resp, srv.chat_requests()

    resp, requests = run(go())
    assert resp.stop_reason == "end_turn"
    seen = [m["content"] for m in requests[1]["messages"] if m["role"] == "tool"][0]
    assert "a * b  # unsaved" in seen
    assert editor.writes == [(calc, "def add(a, b):\n    return a + b  # unsaved\n")]
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a - b\n"  # the disk untouched
    diff = next(u for u in editor.of("tool_call_update") if u.content and u.content[0].type == "diff").content[0]
    assert diff.old_text.endswith("a * b  # unsaved\n") and diff.new_text.endswith("a + b  # unsaved\n")


def test_mcp_servers_the_editor_passes_join_the_tools_and_obey_the_mode(repo):
    """session/new's mcpServers go through our MCP client: the model calls the server's read-only tool;
    its writing tool is refused in ask mode like any writer."""
    pytest.importorskip("mcp")
    from acp.schema import McpServerStdio

    server = McpServerStdio(name="fx", command=sys.executable,
                            args=[str(Path(__file__).with_name("mcp_server.py")), "stdio"], env=[])
    script = [{"tool_calls": [{"name": "fx__lookup", "arguments": {"key": "answer"}},
                              {"name": "fx__append_note", "arguments": {"path": "note.txt", "text": "x"}}]},
              {"content": "Looked it up."}]
    editor = Editor()

    async def go():
        with ScriptedServer(script) as srv:
            cmd = agent_cmd("acp", "--base-url", srv.base_url, "--mode", "ask")
            async with spawn_agent_process(editor, cmd[0], *cmd[1:], env=env_for(repo), cwd=str(repo)) as (conn, _):
                await conn.initialize(protocol_version=PROTOCOL_VERSION, client_capabilities=ClientCapabilities())
                new = await conn.new_session(cwd=str(repo), mcp_servers=[server])
                resp = await conn.prompt(session_id=new.session_id, prompt=[text_block("look up the answer")])
            return new, resp, srv.chat_requests()

    new, resp, requests = run(go())
    assert new.modes.current_mode_id == "ask" and resp.stop_reason == "end_turn"
    assert {"fx__lookup", "fx__append_note"} <= {t["function"]["name"] for t in requests[0]["tools"]}
    ends = {u.tool_call_id: u for u in editor.of("tool_call_update")}
    assert sorted(u.status for u in ends.values()) == ["completed", "failed"]
    assert "forty-two" in [m["content"] for m in requests[1]["messages"] if m["role"] == "tool"][0]
    assert not (repo / "note.txt").exists() and not editor.asks


class TerminalEditor(Editor):
    """An editor offering terminals: terminal/* really run the command in a subprocess of the client (in
    its own process group, as an editor's terminal is) with a marker in its environment, so output that
    carries the marker can only have come from here."""

    def __init__(self):
        super().__init__()
        self.terminals: dict[str, Any] = {}
        self.calls: list[tuple[str, str]] = []

    async def create_terminal(self, session_id: str, command: str, args: Any = None, env: Any = None,
                              cwd: Any = None, output_byte_limit: Any = None, **kw: Any):
        from acp.schema import CreateTerminalResponse

        tid = f"term-{len(self.terminals) + 1}"
        proc = await asyncio.create_subprocess_exec(
            command, *(args or []), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **{e.name: e.value for e in env or []}, "IN_EDITOR_TERMINAL": "yes"})
        out = bytearray()

        async def read():
            while chunk := await proc.stdout.read(4096):
                out.extend(chunk)

        self.terminals[tid] = (proc, out, asyncio.create_task(read()))
        self.calls.append(("create", tid))
        return CreateTerminalResponse(terminal_id=tid)

    async def terminal_output(self, session_id: str, terminal_id: str, **kw: Any):
        from acp.schema import TerminalExitStatus, TerminalOutputResponse

        proc, out, _ = self.terminals[terminal_id]
        self.calls.append(("output", terminal_id))
        rc = proc.returncode
        status = None if rc is None else TerminalExitStatus(exit_code=rc if rc >= 0 else None,
                                                            signal=None if rc >= 0 else f"signal {-rc}")
        return TerminalOutputResponse(output=out.decode(), truncated=False, exit_status=status)

    async def wait_for_terminal_exit(self, session_id: str, terminal_id: str, **kw: Any):
        from acp.schema import WaitForTerminalExitResponse

        proc, _, reader = self.terminals[terminal_id]
        rc = await proc.wait()
        await reader
        return WaitForTerminalExitResponse(exit_code=rc if rc >= 0 else None, signal=None if rc >= 0 else str(-rc))

    async def kill_terminal(self, session_id: str, terminal_id: str, **kw: Any):
        self.calls.append(("kill", terminal_id))
        proc = self.terminals[terminal_id][0]
        if proc.returncode is None:
            os.killpg(proc.pid, 9)

    async def release_terminal(self, session_id: str, terminal_id: str, **kw: Any):
        self.calls.append(("release", terminal_id))


async def terminal_session(editor: Editor, repo: Path, srv: ScriptedServer):
    cmd = agent_cmd("acp", "--base-url", srv.base_url, "--approval", "auto")
    ctx = spawn_agent_process(editor, cmd[0], *cmd[1:], env=env_for(repo), cwd=str(repo))
    conn, _ = await ctx.__aenter__()
    await conn.initialize(protocol_version=PROTOCOL_VERSION, client_capabilities=ClientCapabilities(terminal=True))
    return ctx, conn, (await conn.new_session(cwd=str(repo), mcp_servers=[])).session_id


def test_shell_runs_in_the_editors_terminal_and_a_timeout_kills_it(repo):
    """clientCapabilities.terminal: the shell command runs through terminal/create in the editor (the
    marker only its terminals have is in the output), the tool call shows that terminal, the model gets
    the usual result (output, exit code); a command past its timeout_s is killed through terminal/kill.
    Every terminal is released."""
    script = [{"tool_calls": [{"name": "shell", "arguments": {"command": "echo marker=$IN_EDITOR_TERMINAL; pwd; exit 3"}}]},
              {"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 30 && touch late", "timeout_s": 1}}]},
              {"content": "Done."}]
    editor = TerminalEditor()

    async def go():
        with ScriptedServer(script) as srv:
            ctx, conn, sid = await terminal_session(editor, repo, srv)
            try:
                resp = await conn.prompt(session_id=sid, prompt=[text_block("run it")])
            finally:
                await ctx.__aexit__(None, None, None)
            return resp, srv.chat_requests()

    resp, requests = run(go())
    assert resp.stop_reason == "end_turn"
    told = [m["content"] for m in requests[2]["messages"] if m["role"] == "tool"]
    assert "marker=yes" in told[0] and str(repo) in told[0] and "exit code 3" in told[0]
    assert "timed out after 1 s: the editor killed the command (exit code 124)" in told[1]
    assert editor.calls == [("create", "term-1"), ("output", "term-1"), ("release", "term-1"),
                            ("create", "term-2"), ("kill", "term-2"), ("output", "term-2"), ("release", "term-2")]
    starts = [u.tool_call_id for u in editor.of("tool_call")]
    shown = [(u.tool_call_id, [(c.type, getattr(c, "terminal_id", None)) for c in u.content or []])
             for u in editor.of("tool_call_update")]
    for call, tid in zip(starts, ("term-1", "term-2"), strict=True):
        assert [c for i, c in shown if i == call] == [[("terminal", tid)]] * 2  # while running, and finished
    time.sleep(0.2)
    assert not (repo / "late").exists()


def test_cancel_kills_the_command_in_the_editors_terminal(repo):
    """session/cancel while a command runs in the editor's terminal: terminal/kill, the prompt answers
    `cancelled` at once, the command never finishes, the terminal is released."""
    script = [{"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 30 && touch late"}}]},
              {"content": "never"}]
    editor = TerminalEditor()

    async def go():
        with ScriptedServer(script) as srv:
            ctx, conn, sid = await terminal_session(editor, repo, srv)
            try:
                task = asyncio.create_task(conn.prompt(session_id=sid, prompt=[text_block("sleep")]))
                while not editor.terminals:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)
                t0 = time.perf_counter()
                await conn.cancel(session_id=sid)
                resp = await task
                took = time.perf_counter() - t0
            finally:
                await ctx.__aexit__(None, None, None)
            return resp, took

    resp, took = run(go())
    print(f"\ncancel → prompt answered with the editor's terminal killed: {took * 1000:.0f} ms")
    assert resp.stop_reason == "cancelled" and took < 3.0
    assert editor.calls == [("create", "term-1"), ("kill", "term-1"), ("output", "term-1"), ("release", "term-1")]
    assert editor.terminals["term-1"][0].returncode == -9
    time.sleep(0.2)
    assert not (repo / "late").exists()
