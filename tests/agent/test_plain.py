"""Line mode end to end: `composer-agent --plain` in a pseudo-terminal (pexpect) against a scripted
OpenAI-compatible server on loopback, with real tools on a temporary git repository."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from agent import history
from agent.scripted import ScriptedServer

from ..conftest import git

ROOT = Path(__file__).resolve().parents[2]
COLOUR = re.compile(r"\x1b\[[0-9;]*m")
# The status line printed after an answer (tok/s is left out when a reply streamed faster than 1 ms).
STATUS_LINE = r"ctx \S+ \(\d+%\)[^\r\n]* \d+(\.\d)?s"


@pytest.fixture
def repo(git_repo: Path) -> Path:
    (git_repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git(git_repo, "add", "-A")
    git(git_repo, "commit", "-qm", "init")
    return git_repo


def spawn(repo: Path, srv: ScriptedServer, *args: str, term: str = "xterm-256color", colour: bool = False,
          plain: bool = True) -> pexpect.spawn:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": term, "XDG_CONFIG_HOME": str(repo.parent / "xdg"),
           "PROMPT_TOOLKIT_NO_CPR": "1"}  # nobody answers cursor-position requests in a test pty
    for var in ("COMPOSER_BASE_URL", "COMPOSER_MODEL", "COMPOSER_API_KEY", "COMPOSER_CONTEXT_WINDOW", "NO_COLOR"):
        env.pop(var, None)
    if not colour:
        env["NO_COLOR"] = "1"
    argv = ["-m", "agent.cli", "--cwd", str(repo), "--base-url", srv.base_url, *(["--plain"] if plain else []), *args]
    child = pexpect.spawn(sys.executable, argv, env=env, encoding="utf-8", timeout=20, dimensions=(40, 120))
    child.logfile_read = io.StringIO()  # everything the terminal showed, for assertions at the end
    child.expect("Ctrl-D quits")
    return child


def at_prompt(child: pexpect.spawn) -> None:
    child.expect("›")
    time.sleep(0.2)  # keys sent before prompt-toolkit takes the terminal would be eaten by the line discipline


def quit_with_ctrl_d(child: pexpect.spawn) -> int:
    for _ in range(20):
        child.sendcontrol("d")
        if child.expect([pexpect.EOF, pexpect.TIMEOUT], timeout=0.5) == 0:
            break
    child.close()
    return child.exitstatus


def test_parallel_tool_calls_stream_one_line_each_and_edits_show_a_coloured_diff(repo):
    script = [
        {"content": "Looking at it.",
         "tool_calls": [{"name": "shell", "arguments": {"command": "sleep 0.5; echo one"}},
                        {"name": "shell", "arguments": {"command": "sleep 0.5; echo two"}},
                        {"name": "read_file", "arguments": {"path": "calc.py"}}]},
        {"tool_calls": [{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "a - b",
                                                            "new_string": "a + b"}}]},
        {"content": "Fixed `add`.", "delay_s": 0.01},  # paced, so the reply streams for more than 1 ms
    ]
    with ScriptedServer(script) as srv:
        child = spawn(repo, srv, "--approval", "auto", colour=True)
        at_prompt(child)
        child.send("fix add\r")
        child.expect("Fixed `add`.")
        child.expect(STATUS_LINE)
        raw = child.logfile_read.getvalue()
        out = COLOUR.sub("", raw)
        assert quit_with_ctrl_d(child) == 0
    lines = [ln.strip() for ln in out.replace("\r", "").splitlines()]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("→ shell")]
    ends = [i for i, ln in enumerate(lines) if ln.startswith("✓ shell")]
    assert len(starts) == 2 and len(ends) == 2 and max(starts) < min(ends)  # both ran at once
    assert "✓ shell sleep 0.5; echo one · exit 0" in out and "✓ read_file calc.py · lines 1–2 of 2" in out
    assert "✓ edit_file calc.py · +1 −1" in out
    assert "\x1b[31m    -    return a - b\x1b[0m" in raw and "\x1b[32m    +    return a + b\x1b[0m" in raw
    assert re.search(r"ctx [\d.]+k/32\.8k \(\d+%\) · \d+ tok/s", out)
    assert (repo / "calc.py").read_text().endswith("return a + b\n")


def test_approvals_are_asked_inline_one_granted_one_denied_with_a_reason(repo):
    script = [
        {"tool_calls": [{"name": "shell", "arguments": {"command": "echo yes > approved.txt"}}]},
        {"tool_calls": [{"name": "shell", "arguments": {"command": "echo no > denied.txt"}}]},
        {"content": "Understood."},
    ]
    with ScriptedServer(script) as srv:
        child = spawn(repo, srv)  # no --approval, no config: line mode asks by default
        assert "approval: ask" in child.before
        at_prompt(child)
        child.send("make two files\r")
        child.expect(r"\? Run this command\?")
        child.expect(r"\$ echo yes > approved.txt")
        child.expect(r"\[n\]o:")
        time.sleep(0.2)
        child.send("y")  # one key answers, no Enter, as in the full-screen app
        child.expect(r"✓ shell echo yes > approved.txt · exit 0")
        child.expect(r"\$ echo no > denied.txt")
        child.expect(r"\[n\]o:")
        time.sleep(0.2)
        child.send("n")
        child.expect("Why not")
        child.send("write it in Python\r")
        child.expect(r"✗ shell echo no > denied.txt · declined")
        child.expect("Understood.")
        at_prompt(child)
        assert quit_with_ctrl_d(child) == 0
        told = srv.chat_requests()[2]["messages"][-1]["content"]
    assert (repo / "approved.txt").read_text() == "yes\n" and not (repo / "denied.txt").exists()
    assert "declined" in told and "write it in Python" in told


@pytest.mark.parametrize("where", ["question", "reason"])
def test_ctrl_d_at_an_approval_question_quits_cleanly(repo, where):
    """Ctrl-D quits wherever the app waits for input: at the question and at "Why not?" alike, with no
    traceback, the call not run and no thread left to hang the exit."""
    script = [{"tool_calls": [{"name": "shell", "arguments": {"command": "echo yes > approved.txt"}}]},
              {"content": "never asked for"}]
    with ScriptedServer(script) as srv:
        child = spawn(repo, srv)
        at_prompt(child)
        child.send("make a file\r")
        child.expect(r"\[n\]o:")
        if where == "reason":
            time.sleep(0.2)
            child.send("n")
            child.expect("Why not")
        time.sleep(0.2)
        child.sendcontrol("d")
        try:
            child.expect(pexpect.EOF, timeout=10)
        finally:
            child.close(force=True)
        out = COLOUR.sub("", child.logfile_read.getvalue())
    assert "Traceback" not in out and child.exitstatus == 0, out
    assert not (repo / "approved.txt").exists()
    assert "--resume" in out  # left the way Ctrl-D at the prompt leaves: with the command that continues


def test_mention_completion_and_history_recall(repo):
    history.append(history.history_path(repo), "an earlier task")
    with ScriptedServer([{"content": "first answer"}, {"content": "second answer"}]) as srv:
        child = spawn(repo, srv, "--approval", "auto")
        at_prompt(child)
        child.send("explain @cal")
        child.expect("calc.py")  # the completion menu, shown while typing
        child.send("\t")
        time.sleep(0.3)
        child.send("\r")
        child.expect("first answer")
        at_prompt(child)
        child.send("\x1b[A\x1b[A")  # ↑ twice: past this session's message to the saved one
        child.expect("an earlier task")
        child.send("\r")
        child.expect("second answer")
        at_prompt(child)
        assert quit_with_ctrl_d(child) == 0
        sent = [r["messages"][-1]["content"] for r in srv.chat_requests()]
    assert sent[0].startswith("explain @calc.py ") and "return a - b" in sent[0]  # the file was attached
    assert sent[1] == "an earlier task"
    assert history.load(history.history_path(repo))[-2:] == ["explain @calc.py ", "an earlier task"]


def test_ctrl_c_interrupts_the_turn_and_a_second_ctrl_c_quits(repo):
    script = [
        {"content": " ".join(f"w{i}" for i in range(300)), "delay_s": 0.02},
        {"content": "Still here."},
        # A command that ignores SIGTERM keeps the interrupt busy for a second: room for a second Ctrl-C.
        {"tool_calls": [{"name": "shell", "arguments": {"command": "trap '' TERM; sleep 30"}}]},
    ]
    with ScriptedServer(script) as srv:
        child = spawn(repo, srv, "--approval", "auto")
        at_prompt(child)
        child.send("talk\r")
        child.expect("w20 ")
        child.sendintr()
        child.expect("Interrupted.")
        assert "w299" not in child.before
        at_prompt(child)
        child.send("go on\r")
        child.expect("Still here.")
        at_prompt(child)
        child.send("wait\r")
        child.expect("→ shell")
        time.sleep(0.3)
        child.sendintr()
        child.expect("Interrupting")
        child.sendintr()
        child.expect(pexpect.EOF, timeout=10)
        child.close()
    assert child.exitstatus == 130


def test_a_dumb_terminal_gets_line_mode_without_colour(repo):
    script = [{"tool_calls": [{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "a - b",
                                                                  "new_string": "a + b"}}]},
              {"content": "Done."}]
    with ScriptedServer(script) as srv:
        child = spawn(repo, srv, "--approval", "auto", term="dumb", colour=True, plain=False)
        at_prompt(child)
        child.send("fix\r")
        child.expect("Done.")
        child.expect(STATUS_LINE)
        out = child.logfile_read.getvalue()
        assert quit_with_ctrl_d(child) == 0
    assert "    +    return a + b" in out and "\x1b[" not in out


def test_piped_stdin_reads_one_message_per_line_and_answers_from_it(repo):
    script = [{"tool_calls": [{"name": "shell", "arguments": {"command": "echo hi > piped.txt"}}]},
              {"content": "Made it."}]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(repo.parent / "xdg")}
    with ScriptedServer(script) as srv:
        proc = subprocess.run([sys.executable, "-m", "agent.cli", "--cwd", str(repo), "--base-url", srv.base_url],
                              input="make a file\ny\n", capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "Run this command?" in proc.stdout and "Made it." in proc.stdout and "\x1b[" not in proc.stdout
    assert (repo / "piped.txt").read_text() == "hi\n"
    # Leaving says how to come back to this conversation (the session written under --cwd).
    (session,) = (repo / ".composer" / "sessions").glob("*.jsonl")
    hint = f"composer-agent --cwd {repo} --resume {session.stem}"
    assert proc.stdout.rstrip().endswith(hint)

    with ScriptedServer([]) as srv:  # nothing said: nothing to resume, no hint
        proc = subprocess.run([sys.executable, "-m", "agent.cli", "--cwd", str(repo), "--base-url", srv.base_url],
                              input="", capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0 and "--resume" not in proc.stdout, proc.stdout


def test_output_to_a_log_with_a_terminal_for_input_writes_plain_lines(repo, tmp_path):
    """stdin is a terminal, stdout a file: the log gets lines, not prompt-toolkit's redraws."""
    log = tmp_path / "session.log"
    with ScriptedServer([{"content": "The answer is 42."}]) as srv:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "NO_COLOR": "1",
               "XDG_CONFIG_HOME": str(repo.parent / "xdg")}
        cmd = (f"{sys.executable} -m agent.cli --cwd {repo} --base-url {srv.base_url} --plain > {log}")
        child = pexpect.spawn("bash", ["-c", cmd], env=env, encoding="utf-8", timeout=20)
        deadline = time.monotonic() + 20
        while "Ctrl-D quits" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        child.sendline("what is the answer?")
        while "42" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        child.sendeof()
        child.expect(pexpect.EOF)
        child.close()
    text = log.read_text()
    assert "The answer is 42." in text
    assert "\x1b" not in text  # no cursor moves or screen clears in the log
    assert not [line for line in text.splitlines() if line.strip() == "" and len(line) > 20]  # no padded redraws
