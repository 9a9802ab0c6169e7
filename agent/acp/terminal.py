"""ToolContext.terminal over the client's terminal/* methods: the shell tool's command runs in the
editor's terminal, which the person watches live in the tool call (a `terminal` content item).

Called on a tool thread, which blocks; the requests go to the SDK's event loop. The call's id comes from
the ToolCallStarted the session saw on this same thread (the executor's on_start runs on the tool's
thread just before the tool), so parallel commands each land in their own tool call. We wait for the
exit in short slices, checking the deadline and the turn's cancel in between, since a pending
terminal/wait_for_exit cannot be cut short otherwise; on either we ask the editor to kill the command.
The terminal is always released, as the protocol asks, so the editor frees it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from acp import tool_terminal_ref, update_tool_call
from acp.schema import EnvVariable

from agent.tools.base import ToolError
from agent.tools.shell import KEEP_TAIL_BYTES, TerminalRun

KILL_WAIT_S = 10.0  # how long the editor has to confirm the command ended once killed
REQUEST_S = 30.0  # any one terminal request: past this the editor is not answering


class EditorTerminal:
    def __init__(self, server: Any, session_id: str):
        self.server, self.session_id = server, session_id
        self.calls = threading.local()  # .call_id: the tool call this thread is running

    def _call(self, coro: Any, timeout: float = REQUEST_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result(timeout)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float,
            cancel: threading.Event) -> TerminalRun:
        conn, sid = self.server.conn, self.session_id
        try:
            tid = self._call(conn.create_terminal(
                session_id=sid, command=argv[0], args=argv[1:], cwd=str(cwd),
                env=[EnvVariable(name=k, value=v) for k, v in env.items()],
                output_byte_limit=KEEP_TAIL_BYTES)).terminal_id
        except Exception as e:  # noqa: BLE001 - the model is told; nothing ran
            raise ToolError(f"the editor could not start a terminal: {e}") from None
        call_id = getattr(self.calls, "call_id", None)
        if call_id:
            self.server.send((sid, update_tool_call(call_id, content=[tool_terminal_ref(tid)])))
        try:
            done = asyncio.run_coroutine_threadsafe(conn.wait_for_terminal_exit(session_id=sid, terminal_id=tid),
                                                    self.server.loop)
            deadline, stop = time.monotonic() + timeout_s, None
            while not done.done():
                if time.monotonic() > deadline:
                    stop = "timeout"
                elif cancel.is_set():
                    stop = "interrupt"
                if stop:
                    break
                cancel.wait(0.02)
            confirmed = False
            if stop:
                self._call(conn.kill_terminal(session_id=sid, terminal_id=tid))
                try:
                    done.result(KILL_WAIT_S)
                    confirmed = True
                except Exception:  # noqa: BLE001 - said in the result: the kill is not confirmed
                    pass
            out = self._call(conn.terminal_output(session_id=sid, terminal_id=tid))
            status = out.exit_status or (done.result() if done.done() and not done.exception() else None)
            return TerminalRun(out.output, out.truncated, getattr(status, "exit_code", None),
                               getattr(status, "signal", None), stop, confirmed, tid)
        finally:
            try:
                self._call(conn.release_terminal(session_id=sid, terminal_id=tid))
            except Exception:  # noqa: BLE001 - the editor gone or confused: nothing more to free
                pass
