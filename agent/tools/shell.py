"""shell: run a bash command in the workspace, bounded in time and output.

Each call is a fresh `bash -c`, stdin closed, under a small reaper process (agent/tools/reaper.py) that
is a child subreaper: every process the command starts stays in its tree, even one that moved to its
own session (setsid, daemons), so a timeout or an interrupt kills all of them, and the result claims
only the kills the reaper confirmed. Output (stdout and stderr interleaved, as a terminal shows them)
is streamed by a reader thread into `.composer/shell/`; the model gets it cleaned of ANSI escapes and
carriage-return progress bars, cut to head + tail past ~10 k chars, with the path of the full log. The
reader holds only the first and last MiB in memory, so the tail is the real end however long the
output; the log is capped at 64 MiB plus that last MiB, and says so. A background process that keeps
the pipe open does not block the call: once bash exits we stop waiting for the pipe after a moment.

When a front-end offers the editor's terminals (ctx.terminal, ACP's terminal/*), the command runs there
instead, so the person sees it live; the editor owns its processes (a timeout or an interrupt asks it to
kill them), and the model gets the same result: exit code, head + tail, the full log kept when cut.

With `sandbox` the command runs under bubblewrap: the filesystem read-only except the workspace (and
added roots) and a private /tmp, no network. Missing bubblewrap fails closed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext

DEFAULT_TIMEOUT_S = 120
MAX_TIMEOUT_S = 600
HEAD_CHARS = 5000
TAIL_CHARS = 5000
MAX_LOG_BYTES = 64 * 1024 * 1024
# What the reader holds in memory: the output's first and last bytes (the model sees head + tail).
KEEP_HEAD_BYTES = 1 << 20
KEEP_TAIL_BYTES = 1 << 20
PIPE_GRACE_S = 0.5
KILL_GRACE_S = 1.0
REAPER = Path(__file__).with_name("reaper.py")
# The reaper TERMs the tree, waits 1 s, then KILLs for up to 5 s: past this it is stuck, and we kill it.
REAPER_KILL_WAIT_S = 10.0

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
SHELL_ENV = {
    "PAGER": "cat", "GIT_PAGER": "cat", "MANPAGER": "cat", "TERM": "dumb", "NO_COLOR": "1",
    "CLICOLOR": "0", "PYTHONUNBUFFERED": "1", "GIT_TERMINAL_PROMPT": "0",
    "DEBIAN_FRONTEND": "noninteractive", "COMPOSER_AGENT": "1",
}


@tool(parallel_safe=True, mutates=True)
def shell(
    ctx: ToolContext,
    command: str,
    timeout_s: Annotated[int, {"minimum": 1, "maximum": MAX_TIMEOUT_S}] = DEFAULT_TIMEOUT_S,
) -> ToolResult:
    """Run a bash command in the workspace root and return its exit code and output (stdout and
    stderr together). Stdin is closed, so interactive programs get EOF. Long output is cut to its head
    and tail, with the path of the full log. Independent commands can run in parallel: call this tool
    several times in one turn.

    Args:
        command: The bash command line to run (pipes, &&, redirections allowed).
        timeout_s: Seconds before the command and all its children are killed (default 120, max 600).
    """
    if not command.strip():
        raise ToolError("command is empty")
    argv = ["bash", "-c", command]
    if ctx.sandbox:
        argv = sandbox_argv(ctx) + argv
    log_path = ctx.workspace.state_dir("shell") / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.log"
    if ctx.terminal is not None:
        return _in_terminal(ctx, command, argv, timeout_s, log_path)
    start = time.monotonic()
    run = _Run.start(argv, ctx.root)
    reader = _Reader(run.proc, log_path)
    reader.start()
    stop = run.wait(timeout_s, ctx.cancel)
    reader.join(PIPE_GRACE_S if stop is None else KILL_GRACE_S)
    elapsed = time.monotonic() - start
    snap = reader.snapshot()
    text, cut = model_text(snap, ctx.workspace.display(log_path))
    reader.keep = cut
    reader.finish()
    if run.report.get("spawn_error"):
        raise ToolError(f"could not start the command: {run.report['spawn_error']}")
    rc, status = _status(run, stop, timeout_s)
    body = text.rstrip("\n") if text.strip() else "(no output)"
    content = f"{body}\n[{status}; {elapsed:.1f} s]"
    return ToolResult(content, ok=rc == 0, data={
        "command": command, "exit_code": rc, "timed_out": stop == "timeout", "interrupted": stop == "interrupt",
        "duration_s": round(elapsed, 3), "log_path": ctx.workspace.display(log_path) if cut else None,
        "log_capped": snap.log_capped, "output_bytes": snap.total, "sandboxed": ctx.sandbox,
        "killed": run.report.get("killed", 0), "survivors": run.report.get("survivors", []),
    })


@dataclass
class TerminalRun:
    """What an editor's terminal gives back: its output (the end of it when `truncated`), how the
    command ended, and `stop` ("timeout", "interrupt" or None) with whether the editor confirmed the kill."""

    output: str
    truncated: bool
    exit_code: int | None
    signal: str | None
    stop: str | None
    kill_confirmed: bool = False
    terminal_id: str = ""


def _in_terminal(ctx: ToolContext, command: str, argv: list[str], timeout_s: int, log_path: Path) -> ToolResult:
    """The command in the editor's terminal; the result shaped as the local run's (see _status)."""
    start = time.monotonic()
    run = ctx.terminal.run(argv, ctx.root, SHELL_ENV, timeout_s, ctx.cancel)
    elapsed = time.monotonic() - start
    raw = run.output.encode("utf-8", errors="replace")
    snap = _Snapshot(raw, b"", len(raw), 0, False)
    text, cut = model_text(snap, ctx.workspace.display(log_path))
    if cut:  # the model is told where the whole output is: keep it there
        log_path.write_bytes(raw)
    if run.truncated:
        text = "[… the editor kept only the end of the output …]\n" + text
    if run.stop is None:
        rc = run.exit_code if run.exit_code is not None else -1
        status = f"exit code {rc}" if run.exit_code is not None else f"killed by signal {run.signal or '?'}"
    else:
        rc, why = (124, f"timed out after {timeout_s} s") if run.stop == "timeout" else (130, "interrupted by the user")
        killed = ("the editor killed the command" if run.kill_confirmed else
                  "the kill was sent, but the editor did not confirm that the command ended")
        status = f"{why}: {killed} (exit code {rc})"
    body = text.rstrip("\n") if text.strip() else "(no output)"
    return ToolResult(f"{body}\n[{status}; {elapsed:.1f} s]", ok=rc == 0, data={
        "command": command, "exit_code": rc, "timed_out": run.stop == "timeout",
        "interrupted": run.stop == "interrupt", "duration_s": round(elapsed, 3),
        "log_path": ctx.workspace.display(log_path) if cut else None, "output_bytes": len(raw),
        "sandboxed": ctx.sandbox, "terminal_id": run.terminal_id,
    })


def _status(run: _Run, stop: str | None, timeout_s: int) -> tuple[int, str]:
    """(exit code, what happened in words). A kill is claimed only as far as the reaper confirmed it."""
    if stop is None:
        rc = run.exit_code()
        return rc, f"exit code {rc}" if rc >= 0 else f"killed by signal {-rc}"
    rc, why = (124, f"timed out after {timeout_s} s") if stop == "timeout" else (130, "interrupted by the user")
    return rc, f"{why}: {run.kill_summary()} (exit code {rc})"


class _Run:
    """One command under the reaper (agent/tools/reaper.py), which owns its whole process tree."""

    def __init__(self, proc: subprocess.Popen, status_fd: int):
        self.proc = proc
        self._status_fd = status_fd
        self.report: dict = {}
        self.kill_confirmed = False

    @classmethod
    def start(cls, argv: list[str], cwd: Path) -> _Run:
        read_fd, write_fd = os.pipe()
        reaper = [sys.executable or "python3", "-I", "-S", str(REAPER), str(write_fd), "--", *argv]
        try:
            proc = subprocess.Popen(
                reaper, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, **SHELL_ENV}, pass_fds=(write_fd,),
            )
        except OSError as e:
            os.close(read_fd)
            raise ToolError(f"could not start bash: {e}") from None
        finally:
            os.close(write_fd)
        return cls(proc, read_fd)

    def wait(self, timeout_s: float, cancel: threading.Event) -> str | None:
        """Wait for the command; on timeout or cancel kill its tree. Returns None, "timeout" or "interrupt"."""
        deadline = time.monotonic() + timeout_s
        stop = None
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                stop = "timeout"
            elif cancel.is_set():
                stop = "interrupt"
            if stop:
                self._kill()
                break
            time.sleep(0.02)
        self.proc.wait()
        self.report = self._read_report()
        return stop

    def _kill(self) -> None:
        """Ask the reaper to kill the tree; if it does not answer in time, kill its process group."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(REAPER_KILL_WAIT_S)
            self.kill_confirmed = True
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _read_report(self) -> dict:
        chunks = []
        while chunk := os.read(self._status_fd, 65536):
            chunks.append(chunk)
        os.close(self._status_fd)
        try:
            return json.loads(b"".join(chunks) or b"{}")
        except ValueError:
            return {}

    def exit_code(self) -> int:
        code = self.report.get("exit_code")
        return code if isinstance(code, int) else self.proc.returncode

    def kill_summary(self) -> str:
        """What the kill did, as far as it is known: never more."""
        r = self.report
        if not self.kill_confirmed or "survivors" not in r:
            return "the kill was sent, but it could not be confirmed that the command's processes are gone"
        killed, survivors = r.get("killed", 0), r["survivors"]
        if survivors:
            return (f"killed {_processes(killed)}, but {_processes(len(survivors))} could not be killed "
                    f"(pid {', '.join(map(str, survivors))})")
        if not r.get("tracked"):
            return (f"killed {_processes(killed)} of its process group; processes that left the group "
                    "(setsid, daemons) cannot be tracked on this system")
        return f"killed the command and its children ({_processes(killed)}), none left"


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def sandbox_argv(ctx: ToolContext) -> list[str]:
    bwrap = shutil.which("bwrap")
    if not bwrap:
        raise ToolError("the sandbox was requested but bubblewrap (bwrap) is not installed; "
                        "install it (apt-get install bubblewrap) or run without --sandbox")
    argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for root in (ctx.root, *ctx.workspace.extra_roots):
        argv += ["--bind", str(root), str(root)]
    argv += ["--unshare-net", "--unshare-pid", "--die-with-parent", "--chdir", str(ctx.root)]
    return argv


def clean_output(text: str) -> str:
    """Drop ANSI escapes; keep only the last frame of carriage-return progress lines."""
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    if "\r" in text:
        text = "\n".join(line.rsplit("\r", 1)[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r")
                         for line in text.split("\n"))
    return text


def model_text(snap: _Snapshot, log_shown: str) -> tuple[str, bool]:
    """The output as the model sees it, and whether it was cut (then the log is kept).

    When the reader kept everything, the cleaned text is cut to head + tail by characters. Past its
    memory the middle is gone: the head comes from the first bytes and the tail from the last ones,
    starting at a line boundary so a split character or escape sequence does not garble it.
    """
    if not snap.gap:
        text = clean_output(_decode(snap.head + snap.tail))
        if len(text) <= HEAD_CHARS + TAIL_CHARS:
            return text, False
        omitted = f"{len(text) - HEAD_CHARS - TAIL_CHARS} chars omitted"
        head, tail = text[:HEAD_CHARS], text[-TAIL_CHARS:]
    else:
        head = clean_output(_decode(snap.head))[:HEAD_CHARS]
        tail_bytes = snap.tail[snap.tail.find(b"\n") + 1 :]
        tail = clean_output(_decode(tail_bytes))[-TAIL_CHARS:]
        omitted = f"{_size(snap.total)} of output in all, the middle omitted"
    where = f"full output in {log_shown}"
    if snap.log_capped:
        where = (f"the log {log_shown} is capped: it keeps the first {_size(MAX_LOG_BYTES)} and the last "
                 f"{_size(KEEP_TAIL_BYTES)}")
    return f"{head}\n… [{omitted}; {where}] …\n{tail}", True


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _size(n: int) -> str:
    if n < 1 << 20:
        return f"{n} bytes"
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n / (1 << 20):.1f} MiB"


@dataclass
class _Snapshot:
    head: bytes
    tail: bytes
    total: int
    gap: int  # bytes between head and tail that were not kept in memory
    log_capped: bool


class _Reader(threading.Thread):
    """Drains the pipe into a log file, keeping in memory only the first and the last bytes.

    Memory stays bounded however much a command prints: the first KEEP_HEAD_BYTES, and a ring of the
    last KEEP_TAIL_BYTES. The log keeps the first MAX_LOG_BYTES; past that, at the end of the output,
    it gets a line saying how much was left out, then the ring, so it too ends with the real end.
    """

    def __init__(self, proc: subprocess.Popen, log_path: Path):
        super().__init__(daemon=True)
        self.proc = proc
        self.log_path = log_path
        self.head = bytearray()
        self.tail: deque[bytes] = deque()
        self.tail_bytes = 0
        self.total = 0
        self.gap = 0
        self.log_capped = False
        self.lock = threading.Lock()
        self.keep = False

    def run(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        with open(self.log_path, "wb") as log:
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                room = MAX_LOG_BYTES - self.total
                if room > 0:
                    log.write(chunk[:room])
                with self.lock:
                    self._keep(chunk)
            self._end_log(log)

    def _keep(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = KEEP_HEAD_BYTES - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        self.tail.append(chunk)
        self.tail_bytes += len(chunk)
        while self.tail_bytes - len(self.tail[0]) >= KEEP_TAIL_BYTES:
            dropped = self.tail.popleft()
            self.tail_bytes -= len(dropped)
            self.gap += len(dropped)

    def _end_log(self, log) -> None:
        """Past the cap, write the kept tail after a note of what the log leaves out."""
        beyond = self.total - MAX_LOG_BYTES
        if beyond <= 0:
            return
        with self.lock:
            tail = b"".join(self.tail)
        if beyond <= len(tail):  # the ring still holds everything the log missed: the log is whole
            log.write(tail[-beyond:])
            return
        tail = tail[tail.find(b"\n") + 1 :]
        self.log_capped = True
        log.write(f"\n[… {beyond - len(tail)} bytes omitted: this log keeps the first {_size(MAX_LOG_BYTES)} "
                  f"and the last {_size(KEEP_TAIL_BYTES)} of the output …]\n".encode())
        log.write(tail)

    def snapshot(self) -> _Snapshot:
        with self.lock:
            capped = self.log_capped or self.total - MAX_LOG_BYTES > self.tail_bytes
            return _Snapshot(bytes(self.head), b"".join(self.tail), self.total, self.gap, capped)

    def finish(self) -> None:
        if not self.keep:
            try:
                self.log_path.unlink()
            except FileNotFoundError:
                pass
