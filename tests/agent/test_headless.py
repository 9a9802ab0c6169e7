"""End to end: `composer-agent --task` as a subprocess against a scripted OpenAI-compatible server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agent.scripted import ScriptedServer
from agent.session import find_session, load

from ..conftest import git

BIN = Path(sys.executable).parent / "composer-agent"


def agent_cmd(*args: str) -> list[str]:
    if BIN.exists():
        return [str(BIN), *args]
    return [sys.executable, "-m", "agent.cli", *args]


def run_agent(repo: Path, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "XDG_CONFIG_HOME": str(repo.parent / "xdg"), **(env or {})}
    for var in ("COMPOSER_BASE_URL", "COMPOSER_MODEL", "COMPOSER_API_KEY", "COMPOSER_CONTEXT_WINDOW"):
        full_env.pop(var, None) if not (env and var in env) else None
    return subprocess.run(agent_cmd("--cwd", str(repo), *args), capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


@pytest.fixture
def buggy_repo(git_repo: Path) -> Path:
    (git_repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (git_repo / "test_calc.py").write_text("from calc import add\n\nassert add(2, 3) == 5\nprint('checks pass')\n")
    git(git_repo, "add", "-A")
    git(git_repo, "commit", "-qm", "init")
    return git_repo


FIX_SCRIPT = [
    {"content": "Reading both files.",
     "tool_calls": [{"name": "read_file", "arguments": {"path": "calc.py"}},
                    {"name": "read_file", "arguments": {"path": "test_calc.py"}},
                    {"name": "grep", "arguments": {"pattern": "def add"}}]},
    {"tool_calls": [{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "return a - b",
                                                        "new_string": "return a + b"}}]},
    {"tool_calls": [{"name": "shell", "arguments": {"command": "python3 test_calc.py"}}]},
    {"content": "Fixed `add` in calc.py; `python3 test_calc.py` prints checks pass."},
]


def test_a_task_end_to_end_with_json_events(buggy_repo):
    with ScriptedServer(FIX_SCRIPT) as srv:
        p = run_agent(buggy_repo, "--task", "fix add", "--json", "--base-url", srv.base_url, "--approval", "auto")
        reqs = srv.chat_requests()
    assert p.returncode == 0, p.stderr
    assert (buggy_repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    evs = events(p.stdout)  # every stdout line is a JSON event
    types = [e["type"] for e in evs]
    assert types[0] == "session_started" and types[-1] == "finished"
    assert evs[-1]["status"] == "completed" and "checks pass" in evs[-1]["final_text"]
    assert evs[0]["model"] == "scripted-model" and evs[0]["context_window"] == 32768

    # The three reads of turn 1 ran side by side: all started before the first finished.
    turn1 = [e for e in evs if e.get("turn") == 1 and e["type"].startswith("tool_call")]
    assert [e["type"] for e in turn1[:3]] == ["tool_call_started"] * 3

    # Requests: tools offered in parallel, streamed with usage; results sent back in call order.
    assert len(reqs) == 4
    assert reqs[0]["stream"] is True and reqs[0]["parallel_tool_calls"] is True
    assert reqs[0]["stream_options"] == {"include_usage": True}
    assert [t["function"]["name"] for t in reqs[0]["tools"]][:3] == ["read_file", "write_file", "edit_file"]
    msgs = reqs[1]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool", "tool"]
    assert msgs[1]["content"] == "fix add"
    ids = [tc["id"] for tc in msgs[2]["tool_calls"]]
    assert [m["tool_call_id"] for m in msgs[3:]] == ids
    assert "return a - b" in msgs[3]["content"] and "assert add(2, 3)" in msgs[4]["content"]
    assert "calc.py" in msgs[5]["content"]
    shell_result = reqs[3]["messages"][-1]["content"]
    assert "checks pass" in shell_result and "exit code 0" in shell_result


def test_the_trajectory_holds_exactly_what_was_sent(buggy_repo):
    with ScriptedServer(FIX_SCRIPT) as srv:
        p = run_agent(buggy_repo, "--task", "fix add", "--json", "--base-url", srv.base_url, "--approval", "auto")
        reqs = srv.chat_requests()
    assert p.returncode == 0, p.stderr
    data = load(find_session(buggy_repo / ".composer" / "sessions", "last"))
    sent = [msgs for rec, msgs in data.requests() if rec["purpose"] == "turn"]
    assert sent == [r["messages"] for r in reqs]
    assert data.meta["spec_hash"] == events(p.stdout)[0]["spec_hash"]
    assert data.meta["tools"] == reqs[0]["tools"]
    tools_recs = [r for r in data.records if r["type"] == "tools"]
    assert [c["name"] for c in tools_recs[0]["calls"]] == ["read_file", "read_file", "grep"]
    assert all(c["duration_s"] >= 0 for r in tools_recs for c in r["calls"])
    assert data.records[-1]["type"] == "finished" and data.records[-1]["status"] == "completed"
    assert (buggy_repo / ".composer" / ".gitignore").exists()
    assert git(buggy_repo, "status", "--porcelain").strip() == "M calc.py"


def test_plain_output_prints_the_final_answer(buggy_repo):
    with ScriptedServer(FIX_SCRIPT) as srv:
        p = run_agent(buggy_repo, "--task", "fix add", "--base-url", srv.base_url)
    assert p.returncode == 0
    assert p.stdout.strip() == "Fixed `add` in calc.py; `python3 test_calc.py` prints checks pass."
    assert "→ read_file calc.py" in p.stderr and "→ shell python3 test_calc.py" in p.stderr


def test_retry_after_a_500(buggy_repo):
    with ScriptedServer([{"status": 500}, {"status": 429}, {"content": "done"}]) as srv:
        p = run_agent(buggy_repo, "--task", "x", "--json", "--base-url", srv.base_url)
        n = len(srv.chat_requests())
    assert p.returncode == 0, p.stderr
    retries = [e for e in events(p.stdout) if e["type"] == "retrying"]
    assert [r["attempt"] for r in retries] == [1, 2] and "HTTP 500" in retries[0]["reason"]
    assert "HTTP 429" in retries[1]["reason"]  # rate limited: retried too
    assert n == 3 and events(p.stdout)[-1]["final_text"] == "done"


def test_exit_2_on_a_bad_api_key(buggy_repo):
    with ScriptedServer([{"content": "never"}], api_key="right-key") as srv:
        p = run_agent(buggy_repo, "--task", "x", "--base-url", srv.base_url, "--api-key", "wrong-key")
        ok = run_agent(buggy_repo, "--task", "x", "--base-url", srv.base_url,
                       env={"COMPOSER_API_KEY": "right-key"})
    assert p.returncode == 2 and p.stdout == ""
    scope, *rest = p.stderr.strip().splitlines()  # what it may change, then the error in one line
    assert "read-only" in scope and len(rest) == 1 and "HTTP 401" in rest[0] and "api-key" in rest[0]
    assert ok.returncode == 0 and ok.stdout.strip() == "never"


def test_exit_2_on_an_unreachable_server(buggy_repo):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    start = time.monotonic()
    p = run_agent(buggy_repo, "--task", "x", "--json", "--base-url", f"http://127.0.0.1:{port}/v1")
    assert p.returncode == 2
    assert failure(p.stdout, "unreachable", f"http://127.0.0.1:{port}/v1/models")
    scope, *rest = p.stderr.strip().splitlines()  # what it may change, then the error in one line
    assert "read-only" in scope and len(rest) == 1 and f"http://127.0.0.1:{port}/v1/models" in rest[0]
    assert time.monotonic() - start < 20


def failure(stdout: str, kind: str, text: str) -> dict:
    """The one JSON event a --json run that failed before its loop prints: a final `finished` event."""
    (fin,) = events(stdout)
    assert fin["type"] == "finished" and fin["status"] == "error", fin
    assert fin["error_kind"] == kind and text in fin["error"], fin
    return fin


@pytest.mark.slow
def test_json_mode_reports_server_failures_as_a_final_event_on_stdout(buggy_repo):
    """Scripts read stdout only: each failure ends with a `finished` event (status, error_kind, error)."""
    with ScriptedServer([{"content": "never"}], api_key="right-key") as srv:
        p = run_agent(buggy_repo, "--task", "x", "--json", "--base-url", srv.base_url, "--api-key", "wrong")
        assert p.returncode == 2 and failure(p.stdout, "auth", "HTTP 401")
        p = run_agent(buggy_repo, "--task", "x", "--json", "--base-url", srv.base_url, "--api-key", "right-key",
                      "--model", "gpt-nope")
        assert p.returncode == 2 and failure(p.stdout, "not_found", "'gpt-nope' does not exist")
        p = run_agent(buggy_repo, "--task", "x", "--json", "--base-url", srv.base_url, "--api-key", "right-key",
                      "--resume", "nope")
        assert p.returncode == 2 and failure(p.stdout, "session", "nope")

    # A tiny server that answers the model list but refuses the request itself (a 400 the run cannot fix).
    with ScriptedServer([{"status": 400}]) as srv:
        p = run_agent(buggy_repo, "--task", "x", "--json", "--base-url", srv.base_url)
    assert p.returncode == 1
    evs = events(p.stdout)
    assert evs[0]["type"] == "session_started" and evs[-1]["type"] == "finished"
    assert evs[-1]["status"] == "error" and evs[-1]["error_kind"] == "request" and "HTTP 400" in evs[-1]["error"]


def test_json_mode_reports_usage_and_config_errors_on_stdout(buggy_repo, capsys, monkeypatch):
    from agent.cli import main

    for var in ("COMPOSER_BASE_URL", "COMPOSER_MODEL", "COMPOSER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(buggy_repo.parent / "xdg"))
    common = ["--json", "--cwd", str(buggy_repo), "--base-url", "http://127.0.0.1:9/v1"]

    def fails(args: list[str], kind: str, text: str) -> None:
        try:
            code = main([*common, *args])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out, err = capsys.readouterr()
        assert code == 2, (args, err)
        failure(out, kind, text)
        assert text in err  # people still read stderr

    fails(["--task", "x", "--approval", "ask"], "usage", "interactive")
    fails([], "usage", "--json needs --task")
    fails(["--task", " "], "usage", "--task is empty")
    fails(["--task", "x", "--max-turns", "lots"], "usage", "invalid int value")
    (buggy_repo / ".composer").mkdir(exist_ok=True)
    (buggy_repo / ".composer" / "config.toml").write_text("max_turns = 'many'\n")
    fails(["--task", "x"], "config", "max_turns")


@pytest.mark.slow
def test_task_dash_reads_the_task_from_stdin(buggy_repo):
    task = "fix add in calc.py\n\nthe test is test_calc.py\n"
    with ScriptedServer([{"content": "Read it."}]) as srv:
        env = {**os.environ, "XDG_CONFIG_HOME": str(buggy_repo.parent / "xdg")}
        p = subprocess.run(agent_cmd("--cwd", str(buggy_repo), "--task", "-", "--base-url", srv.base_url),
                           input=task, capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == 0, p.stderr
        assert srv.chat_requests()[0]["messages"][-1]["content"] == task.rstrip()

        p = subprocess.run(agent_cmd("--cwd", str(buggy_repo), "--task", "-", "--json", "--base-url", srv.base_url),
                           input=" \n", capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == 2 and "stdin is empty" in p.stderr
        failure(p.stdout, "usage", "stdin is empty")

        primary, secondary = os.openpty()  # a real terminal on stdin: nobody is going to type a task there
        try:
            p = subprocess.run(agent_cmd("--cwd", str(buggy_repo), "--task", "-", "--base-url", srv.base_url),
                               stdin=secondary, capture_output=True, text=True, env=env, timeout=60)
        finally:
            os.close(primary)
            os.close(secondary)
        assert p.returncode == 2 and "stdin is a terminal" in p.stderr
        assert len(srv.chat_requests()) == 1


def test_exit_2_on_an_unknown_model(buggy_repo):
    with ScriptedServer([{"content": "never"}]) as srv:
        p = run_agent(buggy_repo, "--task", "x", "--base-url", srv.base_url, "--model", "gpt-nope")
    assert p.returncode == 2 and "'gpt-nope' does not exist" in p.stderr and "scripted-model" in p.stderr


def test_usage_errors_exit_2(buggy_repo):
    p = run_agent(buggy_repo, "--task", "x", "--approval", "ask", "--base-url", "http://127.0.0.1:9/v1")
    assert p.returncode == 2 and "interactive" in p.stderr
    p = run_agent(buggy_repo, "--task", "x", "--base-url", "ftp://x")
    assert p.returncode == 2 and "base_url" in p.stderr
    p = run_agent(buggy_repo, "--task", "x", "--resume", "nope", "--base-url", "http://127.0.0.1:9/v1")
    assert p.returncode == 2
    p = run_agent(buggy_repo, "--json", "--base-url", "http://127.0.0.1:9/v1")
    assert p.returncode == 2 and "--json needs --task" in p.stderr
    p = run_agent(buggy_repo, "--task", "x", "--add-dir", "../no-such-folder", "--base-url", "http://127.0.0.1:9/v1")
    assert p.returncode == 2 and "no-such-folder is not a directory" in p.stderr


def test_added_folders_are_usable_and_others_are_not(buggy_repo, tmp_path):
    lib = tmp_path / "sibling-lib"
    lib.mkdir()
    (lib / "util.py").write_text("VALUE = 1\n")
    outside = tmp_path / "private.txt"
    outside.write_text("secret\n")
    turns = [{"tool_calls": [{"name": "edit_file", "arguments": {"path": str(lib / "util.py"),
                                                                 "old_string": "1", "new_string": "2"}},
                             {"name": "read_file", "arguments": {"path": str(outside)}}]},
             {"content": "done"}]
    with ScriptedServer(turns) as srv:
        p = run_agent(buggy_repo, "--task", "x", "--json", "--base-url", srv.base_url, "--add-dir", str(lib),
                      "--approval", "auto")
        system = srv.chat_requests()[0]["messages"][0]["content"]
    assert p.returncode == 0, p.stderr
    assert (lib / "util.py").read_text() == "VALUE = 2\n"
    results = {e["name"]: e for e in events(p.stdout) if e["type"] == "tool_call_finished"}
    assert results["edit_file"]["ok"] and not results["read_file"]["ok"]
    assert "outside the workspace" in results["read_file"]["content"]
    assert str(lib) in system


def test_repo_config_file_is_used_and_flags_win(buggy_repo):
    with ScriptedServer([{"content": "from config"}, {"content": "from flags"}]) as srv:
        (buggy_repo / ".composer").mkdir(exist_ok=True)
        (buggy_repo / ".composer" / "config.toml").write_text(f'base_url = "{srv.base_url}"\nmax_turns = 3\n')
        p = run_agent(buggy_repo, "--task", "x")
        assert p.returncode == 0 and p.stdout.strip() == "from config"
        p = run_agent(buggy_repo, "--task", "x", "--base-url", "http://127.0.0.1:9/v1")
        assert p.returncode == 2  # the flag beat the file
        p = run_agent(buggy_repo, "--task", "x", "--model", "scripted-model")
        assert p.stdout.strip() == "from flags"


def test_summarization_on_a_small_window_then_finishing(buggy_repo):
    (buggy_repo / "big.txt").write_text("".join(f"line {i}: some filler text to make it long\n" for i in range(600)))
    script = [
        {"tool_calls": [{"name": "read_file", "arguments": {"path": "big.txt"}}]},
        {"tool_calls": [{"name": "read_file", "arguments": {"path": "calc.py"}}]},
        {"content": "All done after the summary."},
    ]
    summary = ("## Goal\nRead big.txt.\n## User instructions\nNone.\n## Discoveries\nbig.txt is filler.\n"
               "## Done\nRead big.txt.\n## Relevant files\nbig.txt\n## Next steps\nRead calc.py.")
    with ScriptedServer(script, summaries=[summary]) as srv:
        p = run_agent(buggy_repo, "--task", "read things", "--json", "--base-url", srv.base_url,
                      "--context-window", "8000")
        reqs = srv.chat_requests()
    assert p.returncode == 0, p.stderr
    evs = events(p.stdout)
    summaries = [e for e in evs if e["type"] == "summary"]
    assert len(summaries) == 1 and summaries[0]["segment"] == 1
    assert summaries[0]["tokens_before"] >= 6400 > summaries[0]["tokens_after"]
    assert evs[-1]["status"] == "completed" and evs[-1]["final_text"] == "All done after the summary."
    summary_req = next(r for r in reqs if "tools" not in r)
    assert "## Next steps" in summary_req["messages"][-1]["content"]
    after = reqs[reqs.index(summary_req) + 1]["messages"]
    assert after[0]["role"] == "system" and after[1] == {"role": "user", "content": "read things"}
    assert after[2]["content"].startswith("Summary of the work so far") and "Read calc.py." in after[2]["content"]
    assert not any("line 599" in str(m.get("content")) for m in after)  # the big read was compacted away
    data = load(find_session(buggy_repo / ".composer" / "sessions", "last"))
    assert [r["segment"] for r in data.records if r["type"] == "segment"] == [1]
    assert len(data.segments) == 2


def test_resume_continues_a_session(buggy_repo):
    with ScriptedServer([{"content": "first answer"}, {"content": "second answer"}]) as srv:
        p1 = run_agent(buggy_repo, "--task", "first task", "--json", "--base-url", srv.base_url)
        sid = events(p1.stdout)[0]["session_id"]
        p2 = run_agent(buggy_repo, "--task", "follow-up", "--json", "--resume", "last", "--base-url", srv.base_url)
        reqs = srv.chat_requests()
    assert p2.returncode == 0, p2.stderr
    e2 = events(p2.stdout)
    assert e2[0]["session_id"] == sid and e2[0]["resumed"] is True
    msgs = reqs[1]["messages"]
    assert [(m["role"], m["content"]) for m in msgs[1:]] == [
        ("user", "first task"), ("assistant", "first answer"), ("user", "follow-up")]
    assert msgs[0] == reqs[0]["messages"][0]
    assert len(list((buggy_repo / ".composer" / "sessions").glob("*.jsonl"))) == 1


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_text_format_tool_calls_fallback(buggy_repo, fmt):
    script = [
        {"content": "I will fix it.", "text_tool_calls": fmt,
         "tool_calls": [{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "return a - b",
                                                            "new_string": "return a + b"}}]},
        {"content": "done"},
    ]
    with ScriptedServer(script) as srv:
        p = run_agent(buggy_repo, "--task", "fix", "--json", "--base-url", srv.base_url, "--approval", "auto")
        reqs = srv.chat_requests()
    assert p.returncode == 0, p.stderr
    assert "return a + b" in (buggy_repo / "calc.py").read_text()
    assistant = reqs[1]["messages"][2]
    assert assistant["content"] == "I will fix it."
    assert assistant["tool_calls"][0]["function"]["name"] == "edit_file"
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"])["new_string"] == "return a + b"
    deltas = "".join(e["text"] for e in events(p.stdout) if e["type"] == "text_delta")
    assert "<tool_call>" not in deltas and "I will fix it." in deltas


def test_read_only_refuses_writes_with_an_observation(buggy_repo):
    script = [
        {"tool_calls": [{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "a - b",
                                                            "new_string": "a + b"}},
                        {"name": "shell", "arguments": {"command": "touch pwned"}},
                        {"name": "read_file", "arguments": {"path": "calc.py"}}]},
        {"content": "I could not edit; the fix is to use a + b."},
    ]
    with ScriptedServer(script) as srv:
        p = run_agent(buggy_repo, "--task", "fix", "--json", "--approval", "read-only", "--base-url", srv.base_url)
        reqs = srv.chat_requests()
    assert p.returncode == 0
    assert "a - b" in (buggy_repo / "calc.py").read_text() and not (buggy_repo / "pwned").exists()
    results = [m["content"] for m in reqs[1]["messages"] if m["role"] == "tool"]
    assert "read-only" in results[0] and "read-only" in results[1] and "return a - b" in results[2]


def test_headless_changes_nothing_unless_asked_and_its_first_line_says_what_it_may_change(buggy_repo):
    """Read-only by default, as `codex exec` is: a model pointed at a repository must not edit it unasked."""
    script = [{"tool_calls": [{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "a - b",
                                                                  "new_string": "a + b"}},
                              {"name": "shell", "arguments": {"command": "touch made"}}]},
              {"content": "done"}]
    with ScriptedServer(script) as srv:
        p = run_agent(buggy_repo, "--task", "fix", "--json", "--base-url", srv.base_url)
    assert p.returncode == 0, p.stderr
    assert "a - b" in (buggy_repo / "calc.py").read_text() and not (buggy_repo / "made").exists()
    first = p.stderr.splitlines()[0]
    assert first.startswith("composer-agent: read-only") and str(buggy_repo) in first, p.stderr
    assert "--approval auto" in first  # how to let it

    with ScriptedServer(script) as srv:
        p = run_agent(buggy_repo, "--task", "fix", "--base-url", srv.base_url, "--approval", "auto")
    assert p.returncode == 0, p.stderr
    assert "a + b" in (buggy_repo / "calc.py").read_text() and (buggy_repo / "made").exists()
    first = p.stderr.splitlines()[0]
    assert first == f"composer-agent: approval auto: it may edit files in {buggy_repo} and run shell commands, " \
                    "not sandboxed (--sandbox confines them)", p.stderr


def test_max_turns_exits_1(buggy_repo):
    loop = [{"tool_calls": [{"name": "list_dir", "arguments": {}}]}] * 5
    with ScriptedServer(loop) as srv:
        p = run_agent(buggy_repo, "--task", "x", "--json", "--max-turns", "2", "--base-url", srv.base_url)
    assert p.returncode == 1
    fin = events(p.stdout)[-1]
    assert fin["status"] == "max_turns" and fin["turns"] == 2


def test_a_token_budget_caps_each_request_and_ends_with_its_status(buggy_repo):
    """The budget pays for prompts and answers: a request's max_tokens is what is left after its prompt,
    an answer cut there ends the run with the budget's status, and a budget too small sends nothing."""
    long_answer = "word " * 4000  # ~5000 tokens, far more than the budget leaves
    with ScriptedServer([{"content": long_answer}]) as srv:
        p = run_agent(buggy_repo, "--task", "x", "--json", "--token-budget", "6000", "--base-url", srv.base_url)
        (req,) = srv.chat_requests()
    assert p.returncode == 1, p.stderr
    fin = events(p.stdout)[-1]
    assert fin["status"] == "max_tokens" and fin["turns"] == 1
    assert 0 < req["max_tokens"] < 6000
    assert fin["prompt_tokens"] + fin["completion_tokens"] <= 6000 + 50

    with ScriptedServer([{"content": long_answer}]) as srv:
        p = run_agent(buggy_repo, "--task", "x", "--token-budget", "100", "--base-url", srv.base_url)
        assert srv.chat_requests() == []
    assert p.returncode == 1 and "max_tokens" in p.stderr and p.stdout == ""


def test_ctrl_c_kills_tools_saves_the_session_and_exits_130(buggy_repo):
    marker = f"sleep {400 + uuid.uuid4().int % 500}"
    with ScriptedServer([{"tool_calls": [{"name": "shell", "arguments": {"command": marker}}]},
                         {"content": "never reached"}]) as srv:
        env = {**os.environ, "XDG_CONFIG_HOME": str(buggy_repo.parent / "xdg")}
        proc = subprocess.Popen(agent_cmd("--cwd", str(buggy_repo), "--task", "x", "--json", "--base-url",
                                          srv.base_url, "--approval", "auto"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        for line in proc.stdout:
            if json.loads(line)["type"] == "tool_call_started":
                break
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert json.loads(out.splitlines()[-1])["status"] == "interrupted"
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode != 0
    data = load(find_session(buggy_repo / ".composer" / "sessions", "last"))
    assert data.records[-1]["status"] == "interrupted"
    tool_msgs = [m for m in data.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 1 and "interrupted" in tool_msgs[0]["content"]
