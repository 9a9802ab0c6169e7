"""shell: run a bash command in the workspace, bounded in time and output.

Each call is a fresh `bash -c` in a new session (its own process group), stdin closed, so a timeout or
an interrupt kills the whole tree with one killpg. Output (stdout and stderr interleaved, as a terminal
shows them) is streamed by a reader thread into `.composer/shell/`; the model gets it cleaned of ANSI
escapes and carriage-return progress bars, cut to head + tail past ~10 k chars, with the path of the
full log. A background process that keeps the pipe open does not block the call: once bash exits we
stop waiting for the pipe after a moment.

With `sandbox` the command runs under bubblewrap: the filesystem read-only except the workspace (and
added roots) and a private /tmp, no network. Missing bubblewrap fails closed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext

DEFAULT_TIMEOUT_S = 120
MAX_TIMEOUT_S = 600
HEAD_CHARS = 5000
TAIL_CHARS = 5000
MAX_LOG_BYTES = 64 * 1024 * 1024
PIPE_GRACE_S = 0.5
KILL_GRACE_S = 1.0

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
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, cwd=ctx.root, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, **SHELL_ENV},
        )
    except OSError as e:
        raise ToolError(f"could not start bash: {e}") from None
    reader = _Reader(proc, log_path)
    reader.start()
    timed_out = interrupted = False
    while proc.poll() is None:
        if time.monotonic() - start > timeout_s:
            timed_out = True
        elif ctx.cancel.is_set():
            interrupted = True
        if timed_out or interrupted:
            kill_group(proc)
            break
        time.sleep(0.02)
    rc = proc.wait()
    reader.join(PIPE_GRACE_S if not (timed_out or interrupted) else KILL_GRACE_S)
    elapsed = time.monotonic() - start
    raw = reader.snapshot()
    text = clean_output(raw.decode("utf-8", errors="replace"))
    full_log = None
    if len(text) > HEAD_CHARS + TAIL_CHARS:
        full_log = ctx.workspace.display(log_path)
        omitted = len(text) - HEAD_CHARS - TAIL_CHARS
        text = (text[:HEAD_CHARS] + f"\n… [{omitted} chars omitted; full output in {full_log}] …\n"
                + text[-TAIL_CHARS:])
        reader.keep = True
    reader.finish()
    if timed_out:
        status = f"timed out after {timeout_s} s: the command and its children were killed (exit code 124)"
        rc = 124
    elif interrupted:
        status = "interrupted by the user: the command and its children were killed (exit code 130)"
        rc = 130
    else:
        status = f"exit code {rc}" if rc >= 0 else f"killed by signal {-rc}"
    body = text.rstrip("\n") if text.strip() else "(no output)"
    content = f"{body}\n[{status}; {elapsed:.1f} s]"
    return ToolResult(content, ok=rc == 0, data={
        "command": command, "exit_code": rc, "timed_out": timed_out, "interrupted": interrupted,
        "duration_s": round(elapsed, 3), "log_path": full_log, "sandboxed": ctx.sandbox,
    })


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


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after a short grace."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            # bash is gone; make sure no child of the group survived it.
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def clean_output(text: str) -> str:
    """Drop ANSI escapes; keep only the last frame of carriage-return progress lines."""
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    if "\r" in text:
        text = "\n".join(line.rsplit("\r", 1)[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r")
                         for line in text.split("\n"))
    return text


class _Reader(threading.Thread):
    """Drains the pipe into a log file (bounded), keeping the bytes in memory for the result."""

    def __init__(self, proc: subprocess.Popen, log_path: Path):
        super().__init__(daemon=True)
        self.proc = proc
        self.log_path = log_path
        self.buf = bytearray()
        self.lock = threading.Lock()
        self.keep = False
        self._done = False

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
                with self.lock:
                    if len(self.buf) < MAX_LOG_BYTES:
                        self.buf += chunk
                        log.write(chunk)
        self._done = True

    def snapshot(self) -> bytes:
        with self.lock:
            return bytes(self.buf)

    def finish(self) -> None:
        if not self.keep:
            try:
                self.log_path.unlink()
            except FileNotFoundError:
                pass
