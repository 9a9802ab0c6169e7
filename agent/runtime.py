"""Wiring shared by every front-end: config → client → tools → session → Agent."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.client import Model, OpenAIClient
from agent.config import DEFAULT_CONTEXT_WINDOW, Config
from agent.context import system_prompt
from agent.loop import Agent
from agent.protocol import Event, Message, Notice, SessionStarted
from agent.session import SESSIONS_DIR, Session
from agent.tools import Registry, ToolContext, Workspace, default_registry
from agent.tools.context import STATE_DIR
from agent.tools.executor import Approver

INTERRUPTED_RESULT = "(no result: the session was interrupted before this call finished)"


@dataclass
class Runtime:
    agent: Agent
    session: Session
    model: Model
    system: str
    resumed: bool


def sessions_dir(root: Path) -> Path:
    return root / STATE_DIR / SESSIONS_DIR


def build(config: Config, root: Path, *, emit: Callable[[Event], None], approve: Approver | None = None,
          resume: str | None = None, model: Model | None = None, server_window: int | None = None,
          date: str | None = None) -> Runtime:
    """Everything a run needs. `model` defaults to an OpenAIClient already checked by the caller; `date`
    replaces today's in a new session's system prompt."""
    if model is None:
        client = OpenAIClient(config)
        _, server_window = client.check()
        model = client
    window = config.context_window or server_window or DEFAULT_CONTEXT_WINDOW
    workspace = Workspace(root, extra_roots=config.extra_roots(root))
    workspace.temp_dir()  # creates .composer/ with its .gitignore; clears temp files of killed writes
    ctx = ToolContext(workspace=workspace, sandbox=config.sandbox, linters=dict(config.linters))
    registry = default_registry()
    mcp_warnings: list[str] = []
    if config.mcp_servers:  # the MCP SDK loads only when servers are configured
        from agent.mcp_client import connect

        mcp_tools, mcp_warnings = connect(config.mcp_servers, workspace.root, workspace.state_dir("mcp"))
        registry = Registry([*registry, *mcp_tools])
    messages: list[Message] = []
    if resume:
        session, data = Session.resume(sessions_dir(root), resume)
        messages = repair(data.messages)
        for m in messages[len(data.messages):]:
            session.add_message(m)
    else:
        session = Session.create(sessions_dir(root), cwd=str(root), base_url=config.base_url, model=model.name,
                                 spec_hash=registry.spec_hash(), tools=registry.specs(), context_window=window)
    agent = Agent(model, registry, ctx, config, session, context_window=window, emit=emit, approve=approve,
                  messages=messages)
    if resume:  # where the session left off; set, not switched: nothing changed, nothing to record
        agent.mode = data.mode or "code"
    system = messages[0]["content"] if messages else system_prompt(root, workspace.extra_roots, date)
    emit(SessionStarted(session.id, str(root), model.name, config.base_url, registry.spec_hash(), window,
                        resumed=bool(resume), model_builtin=config.builtin_model))
    for warning in mcp_warnings:
        emit(Notice("warning", warning))
    return Runtime(agent, session, model, system, bool(resume))


def repair(messages: list[Message]) -> list[Message]:
    """Give every tool call a result, so a session killed mid-turn can be resumed."""
    out = list(messages)
    answered = {m.get("tool_call_id") for m in out if m.get("role") == "tool"}
    for m in list(out):
        for tc in m.get("tool_calls") or []:
            if tc["id"] not in answered:
                out.append({"role": "tool", "tool_call_id": tc["id"], "content": INTERRUPTED_RESULT})
                answered.add(tc["id"])
    return out
