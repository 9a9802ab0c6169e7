"""MCP servers' tools in the agent, against a real MCP server (tests/agent/mcp_server.py, built with the
official SDK) over stdio and over streamable HTTP on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the mcp extra is not installed")

from agent.approval import Approvals, Decision  # noqa: E402
from agent.config import Config, ConfigError, load_config  # noqa: E402
from agent.mcp_client import Hub, ServerConfig, parse_servers, tool_name  # noqa: E402
from agent.scripted import ScriptedServer  # noqa: E402
from agent.tools import Executor, Registry, ToolCall, ToolContext, default_registry, spec_hash  # noqa: E402

from .test_headless import events, run_agent  # noqa: E402

SERVER = Path(__file__).with_name("mcp_server.py")
STDIO = {"command": sys.executable, "args": [str(SERVER), "stdio"]}


def process_gone(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":  # exited, not yet reaped by its parent
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def stdio_hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    (root / "sub").mkdir()
    os.environ["MCP_TEST_SECRET"] = "s3cret"
    servers = parse_servers(
        {"fx": {**STDIO, "cwd": "sub", "env": {"GREETING": "hi ${MCP_TEST_SECRET}"}, "tool_timeout_s": 1}}
    )
    hub = Hub(servers, root, root / ".composer" / "mcp")
    hub.start()
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def http_url():
    proc = subprocess.Popen([sys.executable, str(SERVER), "http"], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(timeout=10)


def executor(hub: Hub, root: Path, **kw) -> Executor:
    return Executor(Registry([*default_registry(), *hub.tools]), ToolContext.for_root(root), **kw)


def call(ex: Executor, name: str, /, **args):
    return ex.run([ToolCall("c1", name, json.dumps(args))])[0]


# -- configuration ----------------------------------------------------------------------------------


def test_the_sdk_loads_only_to_connect(tmp_path):
    code = (
        "import sys\nfrom agent.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "from agent.config import Config\nimport agent.mcp_client, agent.runtime\n"
        f"Config(mcp_servers={{'fx': {STDIO!r}}})\n"
        "print('MCP_LOADED=' + str('mcp' in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "MCP_LOADED=False"


@pytest.mark.parametrize(
    "table, message",
    [
        ({"a b": STDIO}, "server names may use only"),
        ({"x": {"args": ["a"]}}, "exactly one of `command`"),
        ({"x": {"command": "c", "url": "http://h"}}, "exactly one of `command`"),
        ({"x": {"command": "c", "headers": {}}}, "unknown key(s) headers"),
        ({"x": {"command": "c", "args": "serve"}}, "mcp_servers.x.args must be a list of strings"),
        ({"x": {"command": "c", "env": {"A": 1}}}, "mcp_servers.x.env must be a table of strings"),
        ({"x": {"url": "ftp://h"}}, "must start with http:// or https://"),
        ({"x": {"url": "http://h", "tool_timeout_s": 0}}, "tool_timeout_s must be a positive number"),
        ({"x": "npx server"}, "mcp_servers.x must be a table"),
    ],
)
def test_bad_server_config_is_a_clear_error(table, message):
    with pytest.raises(ConfigError) as e:
        Config(mcp_servers=table)
    assert message in str(e.value)


def test_repo_servers_merge_with_the_users(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "xdg" / "composer").mkdir(parents=True)
    (tmp_path / "xdg" / "composer" / "config.toml").write_text(
        '[mcp_servers.docs]\nurl = "http://127.0.0.1:9/mcp"\n[mcp_servers.gh]\ncommand = "gh-mcp"\n'
        '[mcp_servers.old]\ncommand = "old"\n'
    )
    (tmp_path / ".composer").mkdir()
    (tmp_path / ".composer" / "config.toml").write_text(
        '[mcp_servers.gh]\ncommand = "gh-mcp"\nargs = ["--repo", "."]\n[mcp_servers.old]\nenabled = false\n'
    )
    config = load_config(tmp_path, env={})
    servers = {s.name: s for s in parse_servers(config.mcp_servers)}
    assert set(servers) == {"docs", "gh"}  # `enabled = false` alone turns a user's server off
    assert servers["gh"].args == ["--repo", "."] and servers["docs"].kind == "http"


def test_evaluation_episodes_use_only_composers_tools():
    from agent.tasks.runner import episode_config
    from agent.tasks.spec import Task

    task = Task(id="t", prompt="p", verify="true", workspace="w")
    assert episode_config(Config(mcp_servers={"fx": STDIO}), task, sandbox=False).mcp_servers == {}


def test_tool_names_fit_the_openai_charset():
    assert tool_name("fx", "lookup", set()) == "fx__lookup"
    assert tool_name("fx", "odd.name with spaces", set()) == "fx__odd_name_with_spaces"
    long = tool_name("server", "x" * 100, set())
    assert len(long) == 64 and long.startswith("server__xxx")
    clash = tool_name("fx", "a.b", {"fx__a_b"})
    assert clash != "fx__a_b" and clash.startswith("fx__a_b_")


def test_a_tool_with_a_broken_schema_is_left_out_with_a_warning(tmp_path):
    from mcp.types import Tool as McpTool

    hub = Hub([], tmp_path, tmp_path / "logs")
    try:
        bad = McpTool(name="bad", inputSchema={"type": "object", "properties": {"a": {"type": 5}}})
        assert hub._tool(ServerConfig("s", command="x"), bad, set()) is None
        assert "tool bad has an invalid input schema" in hub.warnings[0]
    finally:
        hub.close()


# -- tools over stdio -------------------------------------------------------------------------------


def test_tools_join_the_registry_with_a_prefix(stdio_hub):
    tools = {t.name: t for t in stdio_hub.tools}
    assert {"fx__lookup", "fx__append_note", "fx__explode", "fx__odd_name_with_spaces"} <= set(tools)
    assert tools["fx__lookup"].parallel_safe and not tools["fx__lookup"].mutates  # readOnlyHint
    assert not tools["fx__append_note"].parallel_safe and tools["fx__append_note"].mutates
    assert tools["fx__lookup"].parameters["required"] == ["key"]
    registry = Registry([*default_registry(), *stdio_hub.tools])
    assert registry.spec_hash() != default_registry().spec_hash()
    names = [s["function"]["name"] for s in registry.specs()]
    assert names[: len(default_registry())] == default_registry().names() and "fx__lookup" in names


def test_results_and_errors_become_observations(stdio_hub, tmp_path):
    ex = executor(stdio_hub, tmp_path)
    assert call(ex, "fx__lookup", key="answer").content == "forty-two"
    assert call(ex, "fx__lookup", key="env:GREETING").content == "hi s3cret"  # env, ${VAR} expanded
    assert call(ex, "fx__lookup", key="cwd").content == str(stdio_hub.root / "sub")
    stats = call(ex, "fx__stats", numbers=[1, 2, 3])
    assert stats.ok and json.loads(stats.content) == {"count": 3, "sum": 6.0, "mean": 2.0}
    assert call(ex, "fx__picture").content == "[image: image/png, 69 bytes, not shown]"
    failed = call(ex, "fx__explode", reason="bad input")
    assert not failed.ok and failed.content.startswith("Error: ") and "explode" in failed.content
    bad_args = call(ex, "fx__lookup", kee="answer")  # checked against the server's schema before sending
    assert not bad_args.ok and "'key' is a required property" in bad_args.content
    start = time.monotonic()
    slow = call(ex, "fx__nap", seconds=10)  # tool_timeout_s = 1
    assert not slow.ok and "timed out after 1 s" in slow.content and time.monotonic() - start < 5
    assert call(ex, "fx__lookup", key="answer").content == "forty-two"  # the server still serves


def test_only_read_only_tools_run_in_parallel(stdio_hub, tmp_path):
    log: list[tuple[str, int]] = []
    lock = threading.Lock()

    def note(kind):
        def hook(index, call, *_):
            with lock:
                log.append((kind, index))

        return hook

    ex = executor(stdio_hub, tmp_path, on_start=note("start"), on_finish=note("end"))
    ex.run([ToolCall("a", "fx__nap", '{"seconds": 0.3}'), ToolCall("b", "fx__nap", '{"seconds": 0.3}')])
    assert log[:2] == [("start", 0), ("start", 1)]  # both running at once
    log.clear()
    note_file = tmp_path / "notes.txt"
    args = json.dumps({"path": str(note_file), "text": "x"})
    ex.run([ToolCall("a", "fx__append_note", args), ToolCall("b", "fx__append_note", args)])
    assert log == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]  # one after the other
    assert note_file.read_text() == "x\nx\n"


def test_approvals_treat_mcp_tools_like_shell(stdio_hub, tmp_path):
    target = tmp_path / "written.txt"
    args = {"path": str(target), "text": "hello"}
    refused = call(executor(stdio_hub, tmp_path, approve=Approvals("read-only")), "fx__append_note", **args)
    assert not refused.ok and "read-only" in refused.content and not target.exists()
    assert call(executor(stdio_hub, tmp_path, approve=Approvals("read-only")), "fx__lookup", key="answer").ok

    asked, previews = [], []

    def ask_user(c, tool, a, preview):
        asked.append(tool.name)
        previews.append(preview)
        return Decision("no", "not now")

    ask = Approvals("ask", ask=ask_user)
    declined = call(executor(stdio_hub, tmp_path, approve=ask), "fx__append_note", **args)
    assert asked == ["fx__append_note"] and "not now" in declined.content and not target.exists()
    shown = "\n".join(text for _, text in previews[0].lines)  # the question shows every argument
    assert previews[0].question.startswith("Allow fx__append_note") and json.loads(shown) == args
    call(executor(stdio_hub, tmp_path, approve=ask), "fx__lookup", key="answer")
    assert asked == ["fx__append_note"]  # read-only tools are not asked about

    assert call(executor(stdio_hub, tmp_path, approve=Approvals("auto")), "fx__append_note", **args).ok
    assert target.read_text() == "hello\n"


def test_interrupt_stops_waiting_for_a_call(stdio_hub, tmp_path):
    ex = executor(stdio_hub, tmp_path)
    threading.Timer(0.3, ex.ctx.cancel.set).start()
    start = time.monotonic()
    r = call(ex, "fx__nap", seconds=5)
    assert not r.ok and r.data.get("interrupted") and time.monotonic() - start < 2


def test_a_server_dying_mid_session_turns_calls_into_errors(stdio_hub, tmp_path):
    # Runs last of the tests on the shared stdio server: it kills it.
    ex = executor(stdio_hub, tmp_path)
    pid = int(call(ex, "fx__lookup", key="pid").content)
    died = call(ex, "fx__die")
    assert not died.ok and "closed the connection" in died.content
    assert process_gone(pid)
    after = call(ex, "fx__lookup", key="answer")
    assert not after.ok and "closed the connection" in after.content


def test_a_failed_or_silent_server_is_one_warning_and_no_tools(tmp_path, capfd):
    servers = parse_servers(
        {
            "missing": {"command": str(tmp_path / "no-such-server")},
            "crashes": {"command": sys.executable, "args": ["-c", "import sys; sys.exit('bad token')"]},
            "silent": {
                "command": sys.executable,
                "args": ["-c", "import sys; print('not JSON-RPC', flush=True); sys.stdin.read()  # silent"],
                "startup_timeout_s": 0.5,
            },
        }
    )
    hub = Hub(servers, tmp_path, tmp_path / "logs")
    start = time.monotonic()
    hub.start()
    assert time.monotonic() - start < 10
    hub.close()
    assert hub.tools == []
    warnings = "\n".join(hub.warnings)
    assert "MCP server missing failed to start: FileNotFoundError" in warnings
    assert "MCP server crashes failed to start" in warnings and "bad token" in warnings  # its stderr's tail
    assert "MCP server silent did not start within 0.5 s" in warnings
    assert subprocess.run(["pgrep", "-f", "# silent"], capture_output=True).returncode == 1  # stopped
    # The SDK's complaint about the junk line went to its log file, not to our stderr.
    import logging

    sdk_log = Path(logging.getLogger("mcp").handlers[0].baseFilename)
    assert "Failed to parse JSONRPC message" in sdk_log.read_text()
    assert "Failed to parse" not in capfd.readouterr().err


def test_front_ends_show_the_warning():
    import io

    from agent.headless import Progress
    from agent.plain.printer import Printer
    from agent.protocol import Notice
    from agent.render import Status

    notice = Notice("warning", "MCP server x did not start within 1 s; its tools are not available.")
    for show in (lambda out: Printer(out, False, Status()), Progress):
        out = io.StringIO()
        show(out)(notice)
        assert "MCP server x did not start" in out.getvalue()


# -- streamable HTTP --------------------------------------------------------------------------------


def test_streamable_http_server(http_url, tmp_path):
    servers = parse_servers({"web": {"url": http_url, "headers": {"X-Team": "${MCP_TEST_TEAM}"}}})
    os.environ["MCP_TEST_TEAM"] = "composer"
    hub = Hub(servers, tmp_path, tmp_path / "logs")
    hub.start()
    try:
        assert hub.warnings == [] and "web__lookup" in {t.name for t in hub.tools}
        ex = executor(hub, tmp_path)
        assert call(ex, "web__lookup", key="answer").content == "forty-two"
        assert call(ex, "web__header", name="X-Team").content == "composer"
        assert not call(ex, "web__explode", reason="x").ok
    finally:
        hub.close()


def test_an_http_server_still_starting_is_retried_within_its_startup_timeout(tmp_path):
    """Refused at first (nothing listens on the port yet): the hub keeps trying, and the server that
    comes up a second later is connected, not reported as failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    servers = parse_servers({"late": {"url": f"http://127.0.0.1:{port}/mcp", "startup_timeout_s": 20}})
    hub = Hub(servers, tmp_path, tmp_path / "logs")
    late = threading.Timer(1.0, lambda: procs.append(subprocess.Popen(
        [sys.executable, str(SERVER), "http", str(port)], stdout=subprocess.PIPE, text=True)))
    procs: list[subprocess.Popen] = []
    late.start()
    try:
        hub.start()
        assert hub.warnings == [] and "late__lookup" in {t.name for t in hub.tools}
        assert call(executor(hub, tmp_path), "late__lookup", key="answer").content == "forty-two"
    finally:
        late.cancel()
        hub.close()
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


def test_an_http_server_that_never_listens_fails_at_its_startup_timeout(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hub = Hub(parse_servers({"none": {"url": f"http://127.0.0.1:{port}/mcp", "startup_timeout_s": 1.5}}),
              tmp_path, tmp_path / "logs")
    t0 = time.monotonic()
    try:
        hub.start()
    finally:
        hub.close()
    assert 1.4 < time.monotonic() - t0 < 10 and len(hub.warnings) == 1 and "did not start" in hub.warnings[0]


# -- a whole run ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_agent_run_calls_mcp_tools_and_leaves_no_server_behind(git_repo, http_url):
    (git_repo / ".composer").mkdir()
    (git_repo / ".composer" / "config.toml").write_text(
        f'[mcp_servers.fx]\ncommand = {json.dumps(sys.executable)}\nargs = [{json.dumps(str(SERVER))}, "stdio"]\n'
        f'[mcp_servers.web]\nurl = "{http_url}"\n'
        '[mcp_servers.broken]\ncommand = "/nonexistent/mcp-server"\n'
    )
    script = [
        {
            "tool_calls": [
                {"name": "fx__lookup", "arguments": {"key": "pid"}},
                {"name": "web__lookup", "arguments": {"key": "answer"}},
            ]
        },
        {"tool_calls": [{"name": "fx__explode", "arguments": {"reason": "x"}}]},
        {"content": "Done."},
    ]
    with ScriptedServer(script) as srv:
        p = run_agent(git_repo, "--task", "use the tools", "--json", "--base-url", srv.base_url)
        reqs = srv.chat_requests()
    assert p.returncode == 0, p.stderr
    evs = events(p.stdout)
    assert evs[0]["type"] == "session_started" and evs[-1]["status"] == "completed"
    notices = [e for e in evs if e["type"] == "notice"]
    assert len(notices) == 1 and notices[0]["level"] == "warning" and "broken" in notices[0]["text"]

    offered = [t["function"]["name"] for t in reqs[0]["tools"]]
    assert "fx__lookup" in offered and "web__lookup" in offered and "broken__lookup" not in offered
    assert evs[0]["spec_hash"] == spec_hash(reqs[0]["tools"]) != default_registry().spec_hash()

    results = {m["tool_call_id"]: m["content"] for m in reqs[1]["messages"] if m["role"] == "tool"}
    pid, answer = results.values()
    assert answer == "forty-two" and pid.isdigit()
    failed = [m for m in reqs[2]["messages"] if m["role"] == "tool"][-1]
    assert failed["content"].startswith("Error: ")
    assert process_gone(int(pid))  # the stdio server exited with the agent
