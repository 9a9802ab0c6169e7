"""`composer-agent acp`: an Agent Client Protocol agent on stdio, over the official Python SDK.

A view like the TUI and line mode: each ACP session is one runtime (agent.runtime.build: the same loop,
tools, approvals, sessions and MCP client), its events turned into `session/update`s (agent/acp/
updates.py), its approval questions into `session/request_permission`. Nothing is decided here that
the loop's policy decides: modes and approvals are the agent's, cancel is `Agent.interrupt` (Esc).

Threads: the SDK runs on asyncio; a turn runs on a worker thread (it blocks on the model and tools).
Events arrive on the turn's and the tools' threads and go through one queue to one sender task, so
the client sees them in the order they happened; a permission question goes through the same queue,
after the tool call it is about, and its tool thread waits on a future that cancel, or the client
going away, answers "no". A prompt answers only once every update of its turn has been written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import re
import threading
from pathlib import Path
from typing import Any

from acp import PROTOCOL_VERSION, RequestError
from acp.schema import (
    AgentCapabilities,
    DeniedOutcome,
    Implementation,
    InitializeResponse,
    LoadSessionResponse,
    McpCapabilities,
    NewSessionResponse,
    PermissionOption,
    PromptCapabilities,
    PromptResponse,
    SessionMode,
    SessionModeState,
    SetSessionModeResponse,
    ToolCallUpdate,
)

from agent import __version__
from agent.acp.terminal import EditorTerminal
from agent.acp.updates import KINDS, EditTexts, replay, title, to_updates
from agent.approval import Approvals, Decision
from agent.client import ModelError
from agent.config import ConfigError, endpoint_source, load_config
from agent.loop import MODES
from agent.protocol import Event, Finished, Notice, ToolCallStarted
from agent.render import Preview
from agent.runtime import Runtime, build
from agent.session import SessionNotFound

log = logging.getLogger("composer.acp")

STOP = {"completed": "end_turn", "no_answer": "end_turn", "max_time": "end_turn", "max_turns": "max_turn_requests",
        "max_tokens": "max_tokens", "interrupted": "cancelled"}
MODE_INFO = [("code", "Code", "Edits files and runs commands, as the approval mode allows"),
             ("ask", "Ask", "Answers from read-only tools: no file is written, no command runs"),
             ("plan", "Plan", "Read-only; ends with a plan (the todo list) to carry out in code mode")]
CANCELLED = "The user cancelled the turn."


class _Flush:
    """A marker in the send queue: set once everything before it is written."""

    def __init__(self) -> None:
        self.done = asyncio.Event()


@dataclasses.dataclass
class _Question:
    session_id: str
    tool_call: ToolCallUpdate
    options: list[PermissionOption]
    answer: concurrent.futures.Future


class AcpSession:
    """One ACP session: a runtime, the turn running in it, the questions it waits on."""

    def __init__(self, server: ComposerAcp, root: Path):
        self.server, self.root = server, root
        self.id = ""
        self.rt: Runtime | None = None
        self.edits = EditTexts(self._read)
        self.pending: set[concurrent.futures.Future] = set()
        self.busy = False
        self.worker: asyncio.Future | None = None  # the turn's thread, kept past a prompt cancelled under it

    async def run(self, task: str) -> Finished:
        assert self.rt is not None
        self.worker = asyncio.ensure_future(asyncio.to_thread(self.rt.agent.run, task, self.rt.system))
        # Shielded: if the SDK drops the request (the client went away), the thread still ends its turn
        # and writes the session's `finished` record, which shutdown waits for.
        return await asyncio.shield(self.worker)

    def _read(self, path: Path) -> str | None:
        """A file as the tools see it: the editor's buffer when it offers one, else the disk."""
        editor = self.rt.agent.ctx.editor if self.rt is not None else None
        text = editor.read(path) if editor is not None else None
        return text if text is not None else _read_text(path)

    def emit(self, event: Event) -> None:  # any thread
        if isinstance(event, Notice):
            log.warning("%s: %s", event.level, event.text)
        terminal = self.rt.agent.ctx.terminal if self.rt is not None else None
        if isinstance(event, ToolCallStarted) and terminal is not None:
            terminal.calls.call_id = event.call_id  # on the tool's thread: the call its terminal belongs to
        for update in to_updates(event, self.root, self.edits):
            self.server.send((self.id, update))

    def ask(self, call: Any, tool: Any, args: dict[str, Any], preview: Preview) -> Decision:  # a tool thread
        options = [PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
                   PermissionOption(option_id="always", name=f"Always allow {tool.name}", kind="allow_always"),
                   PermissionOption(option_id="reject", name="Reject", kind="reject_once")]
        card = ToolCallUpdate(tool_call_id=call.id, title=title(tool.name, args), kind=KINDS.get(tool.name, "other"),
                              status="pending", raw_input=args)
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self.pending.add(answer)
        try:
            self.server.send(_Question(self.id, card, options, answer))
            return answer.result()
        finally:
            self.pending.discard(answer)

    def cancel(self, why: str = CANCELLED) -> None:
        """Esc: the stream stops, commands are killed, questions waiting are answered no."""
        if self.rt is not None:
            self.rt.agent.interrupt()
        for answer in list(self.pending):
            if not answer.done():
                answer.set_result(Decision("no", why))


class EditorFiles:
    """ToolContext.editor over the client's fs/read_text_file and fs/write_text_file, called from tool
    threads (they block on the answer; the event loop stays free)."""

    TIMEOUT_S = 30.0

    def __init__(self, server: ComposerAcp, session_id: str, can_read: bool, can_write: bool):
        self.server, self.session_id = server, session_id
        self.can_read, self.can_write = can_read, can_write

    def _call(self, coro: Any) -> Any:
        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result(self.TIMEOUT_S)

    def read(self, path: Path) -> str | None:
        if not self.can_read:
            return None
        try:
            return self._call(self.server.conn.read_text_file(session_id=self.session_id, path=str(path))).content
        except Exception:  # noqa: BLE001 - not open and not on disk, or the editor says no: the disk decides
            return None

    def write(self, path: Path, text: str) -> bool:
        if not self.can_write:  # False: the tool writes the disk itself
            return False
        try:
            self._call(self.server.conn.write_text_file(session_id=self.session_id, path=str(path), content=text))
        except Exception as e:  # noqa: BLE001 - the model is told, and the file is as it was
            from agent.tools import ToolError

            raise ToolError(f"the editor could not write {path}: {e}") from None
        return True


class ComposerAcp:
    """The ACP agent: the SDK calls these methods, one coroutine per request."""

    def __init__(self, flags: dict[str, Any], mode: str | None = None):
        self.flags, self.mode = flags, mode or "code"  # the mode of new sessions
        self.conn: Any = None
        self.sessions: dict[str, AcpSession] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queue: asyncio.Queue | None = None
        self.builtin: Any = None
        self.fs: Any = None  # the client's file system capabilities, from initialize
        self.terminal = False  # whether the client offers terminal/*, from initialize
        self._builtin_lock = threading.Lock()
        self._sender: asyncio.Task | None = None

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    # -- sending ------------------------------------------------------------------------------------

    def send(self, item: Any) -> None:
        """Queue an update or a question; safe from any thread."""
        assert self.loop is not None and self.queue is not None
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue = asyncio.Queue()
        self._sender = asyncio.create_task(self._send_all())

    async def flush(self) -> None:
        marker = _Flush()
        self.send(marker)
        await marker.done.wait()

    async def _send_all(self) -> None:
        assert self.queue is not None
        while True:
            item = await self.queue.get()
            if isinstance(item, _Flush):
                item.done.set()
            elif isinstance(item, _Question):
                # Its own task: the answer may take minutes, and updates of other calls keep flowing.
                asyncio.create_task(self._ask(item))
            else:
                try:
                    await self.conn.session_update(session_id=item[0], update=item[1])
                except Exception as e:  # noqa: BLE001 - a client gone or confused: the turn goes on
                    log.warning("session/update not sent: %s", e)

    async def _ask(self, q: _Question) -> None:
        try:
            resp = await self.conn.request_permission(session_id=q.session_id, tool_call=q.tool_call,
                                                      options=q.options)
            outcome = resp.outcome
            if isinstance(outcome, DeniedOutcome):
                decision = Decision("no", CANCELLED)
            else:
                reason = str((resp.field_meta or {}).get("reason") or "")
                decision = Decision({"allow": "yes", "always": "always"}.get(outcome.option_id, "no"), reason)
        except Exception as e:  # noqa: BLE001 - no answer is a no
            log.warning("session/request_permission failed: %s", e)
            decision = Decision("no", "The editor did not answer the permission request.")
        if not q.answer.done():
            q.answer.set_result(decision)

    # -- methods ------------------------------------------------------------------------------------

    async def initialize(self, protocol_version: int, client_capabilities: Any = None, client_info: Any = None,
                         **kwargs: Any) -> InitializeResponse:
        self.fs = getattr(client_capabilities, "fs", None)
        self.terminal = bool(getattr(client_capabilities, "terminal", False))
        return InitializeResponse(
            protocol_version=min(protocol_version, PROTOCOL_VERSION),
            agent_capabilities=AgentCapabilities(
                load_session=True, prompt_capabilities=PromptCapabilities(embedded_context=True),
                mcp_capabilities=McpCapabilities(http=True)),
            agent_info=Implementation(name="composer", title="Composer", version=__version__),
        )

    async def new_session(self, cwd: str, mcp_servers: list[Any] | None = None, **kwargs: Any) -> NewSessionResponse:
        s = await self._open(cwd, mcp_servers, resume=None)
        return NewSessionResponse(session_id=s.id, modes=self._modes(s))

    async def load_session(self, cwd: str, session_id: str, mcp_servers: list[Any] | None = None,
                           **kwargs: Any) -> LoadSessionResponse:
        old = self.sessions.pop(session_id, None)
        if old is not None:
            await self._close(old)
        s = await self._open(cwd, mcp_servers, resume=session_id)
        assert s.rt is not None
        for update in replay(s.rt.agent.messages):
            self.send((s.id, update))
        await self.flush()  # the history is on the client before the answer, as the protocol asks
        return LoadSessionResponse(modes=self._modes(s))

    async def set_session_mode(self, session_id: str, mode_id: str, **kwargs: Any) -> SetSessionModeResponse:
        s = self._session(session_id)
        if mode_id not in MODES:
            raise RequestError.invalid_params({"message": f"unknown mode {mode_id!r}; modes: {', '.join(MODES)}"})
        assert s.rt is not None
        s.rt.agent.set_mode(mode_id)
        return SetSessionModeResponse()

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        s = self._session(session_id)
        if s.busy:
            raise RequestError.invalid_request({"message": "a prompt is already running in this session"})
        assert s.rt is not None
        agent = s.rt.agent
        s.busy = True
        try:
            finished = await s.run(prompt_text(prompt))
            if agent.plan_ready(finished) and await self._plan_accepted(s):
                finished = await s.run(agent.accept_plan())
        finally:
            s.busy = False
            await self.flush()
        if finished.status == "error":
            raise RequestError.internal_error({"message": finished.error, "kind": finished.error_kind})
        return PromptResponse(stop_reason=STOP.get(finished.status, "end_turn"))

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        s = self.sessions.get(session_id)
        if s is not None:  # a notification: nothing to answer, even for an unknown id
            s.cancel()

    # -- sessions -----------------------------------------------------------------------------------

    def _session(self, session_id: str) -> AcpSession:
        s = self.sessions.get(session_id)
        if s is None:
            raise RequestError.invalid_params({"message": f"unknown session {session_id!r}"})
        return s

    def _modes(self, s: AcpSession) -> SessionModeState:
        assert s.rt is not None
        return SessionModeState(current_mode_id=s.rt.agent.mode, available_modes=[
            SessionMode(id=i, name=n, description=d) for i, n, d in MODE_INFO])

    async def _open(self, cwd: str, mcp_servers: list[Any] | None, resume: str | None) -> AcpSession:
        root = Path(cwd).expanduser().resolve()
        if not root.is_dir():
            raise RequestError.invalid_params({"message": f"cwd {cwd} is not a directory"})
        s = AcpSession(self, root)
        try:
            rt = await asyncio.to_thread(self._build, s, root, mcp_servers or [], resume)
        except (ConfigError, ModelError) as e:
            raise RequestError.internal_error({"message": str(e)}) from None
        except SessionNotFound as e:
            raise RequestError.invalid_params({"message": str(e)}) from None
        s.id, s.rt = rt.session.id, rt
        can_read, can_write = bool(getattr(self.fs, "read_text_file", False)), bool(
            getattr(self.fs, "write_text_file", False))
        if can_read or can_write:
            rt.agent.ctx.editor = EditorFiles(self, s.id, can_read, can_write)
        if self.terminal:
            rt.agent.ctx.terminal = EditorTerminal(self, s.id)
        self.sessions[s.id] = s
        # A loaded session goes on in the mode it was saved in (runtime.build read it back); --mode, set
        # once in the editor's settings, is for new ones.
        rt.agent.set_mode(rt.agent.mode if resume else self.mode)
        return s

    def _build(self, s: AcpSession, root: Path, mcp_servers: list[Any], resume: str | None) -> Runtime:
        # An editor has a person to ask, so writes and shell ask unless a config or flag says otherwise.
        config = load_config(root, self.flags, defaults={"approval": "ask"})
        if mcp_servers:
            config = dataclasses.replace(config, mcp_servers={**config.mcp_servers, **mcp_table(mcp_servers)})
        if endpoint_source(root, self.flags) is None:
            self._serve_builtin(config)
        approvals = Approvals(config.approval, s.ask)
        rt = build(config, root, emit=s.emit, approve=approvals, resume=resume)
        approvals.ctx = rt.agent.ctx
        return rt

    def _serve_builtin(self, config: Any) -> None:
        """No endpoint configured: the small built-in model, started once for every session."""
        from agent.builtin_model import start_builtin

        with self._builtin_lock:
            if self.builtin is None:
                self.builtin = start_builtin(notice=True)
        self.builtin.configure(config)

    async def _plan_accepted(self, s: AcpSession) -> bool:
        """Ask whether to carry out the plan a plan-mode turn ended with (switching to code)."""
        card = ToolCallUpdate(tool_call_id=f"plan-{s.rt.agent.turn if s.rt else 0}", title="Carry out this plan",
                              kind="switch_mode", status="pending")
        options = [PermissionOption(option_id="allow", name="Switch to code and carry it out", kind="allow_once"),
                   PermissionOption(option_id="reject", name="Keep planning", kind="reject_once")]
        answer: concurrent.futures.Future = concurrent.futures.Future()
        s.pending.add(answer)
        try:
            self.send(_Question(s.id, card, options, answer))
            decision = await asyncio.wrap_future(answer)
        finally:
            s.pending.discard(answer)
        return decision.answer == "yes"

    async def _close(self, s: AcpSession, wait_s: float = 10.0) -> None:
        s.cancel("The editor disconnected.")
        if s.worker is not None:
            try:
                await asyncio.wait_for(asyncio.shield(s.worker), wait_s)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        if s.rt is not None:
            s.rt.session.close()

    async def shutdown(self) -> None:
        """The client went away: end every turn (commands killed), save and close every session."""
        for s in list(self.sessions.values()):
            await self._close(s)
        self.sessions.clear()
        if self.builtin is not None:
            self.builtin.stop()


def mcp_table(servers: list[Any]) -> dict[str, dict[str, Any]]:
    """The MCP servers a client passes, as `[mcp_servers.NAME]` tables for our MCP client."""
    out: dict[str, dict[str, Any]] = {}
    for srv in servers:
        name = re.sub(r"[^A-Za-z0-9_-]", "_", srv.name) or "server"
        if getattr(srv, "command", None):
            out[name] = {"command": srv.command, "args": list(srv.args or []),
                         "env": {e.name: e.value for e in (srv.env or [])}}
        elif getattr(srv, "url", None):
            out[name] = {"url": srv.url, "headers": {h.name: h.value for h in (srv.headers or [])}}
    return out


def prompt_text(blocks: list[Any]) -> str:
    """A prompt's content blocks as one user message: text as is, files the editor attached inline."""
    parts = []
    for b in blocks:
        kind = getattr(b, "type", None)
        if kind == "text":
            parts.append(b.text)
        elif kind == "resource_link":
            parts.append(f"(attached: {b.uri})")
        elif kind == "resource" and getattr(b.resource, "text", None) is not None:
            parts.append(f"<file uri=\"{b.resource.uri}\">\n{b.resource.text}\n</file>")
    return "\n\n".join(parts)


def _read_text(path: Path) -> str | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in raw[:8192]:
        return None
    return raw.decode("utf-8", errors="replace")
