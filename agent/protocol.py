"""The one event stream every front-end consumes, and the message shapes the model side uses.

Pure data, no I/O: the TUI, the line-mode UI, `--json` headless output and the trajectory writer all
read these events; `serve` may import this module. Messages are OpenAI chat-completions dicts
(`{"role": "assistant", "content": ..., "tool_calls": [...]}`), kept as plain dicts so that what is
sent, stored and trained on is byte-for-byte the same JSON.

Every event has a `type` (its JSON tag) and serialises with `to_json()`; `event_from_json` reverses it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

Message = dict[str, Any]


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # True when the server did not report usage and these are estimates (chars / 4).
    estimated: bool = False
    # Prompt tokens the server's prefix cache supplied (usage.prompt_tokens_details.cached_tokens; 0 if unsaid).
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Event:
    type: ClassVar[str] = "event"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, default=str)


@dataclass
class SessionStarted(Event):
    type: ClassVar[str] = "session_started"
    session_id: str
    cwd: str
    model: str
    base_url: str
    spec_hash: str
    context_window: int
    resumed: bool = False
    model_builtin: bool = False  # the small built-in model composer-agent serves itself: a toy, claims unverified


@dataclass
class TurnStarted(Event):
    """A request to the model is about to be sent (turn numbers start at 1)."""

    type: ClassVar[str] = "turn_started"
    turn: int


@dataclass
class TextDelta(Event):
    type: ClassVar[str] = "text_delta"
    turn: int
    text: str


@dataclass
class ReasoningDelta(Event):
    type: ClassVar[str] = "reasoning_delta"
    turn: int
    text: str


@dataclass
class AssistantMessage(Event):
    """The complete assistant message of a turn, as it goes into the history."""

    type: ClassVar[str] = "assistant_message"
    turn: int
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ToolCallStarted(Event):
    type: ClassVar[str] = "tool_call_started"
    turn: int
    index: int
    call_id: str
    name: str
    arguments: Any  # the parsed JSON object, or the raw text when it is not valid JSON


@dataclass
class ToolCallFinished(Event):
    type: ClassVar[str] = "tool_call_finished"
    turn: int
    index: int
    call_id: str
    name: str
    ok: bool
    content: str  # exactly what the model sees
    duration_s: float
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class UsageReport(Event):
    type: ClassVar[str] = "usage"
    turn: int
    prompt_tokens: int
    completion_tokens: int
    total_prompt_tokens: int
    total_completion_tokens: int
    context_window: int
    time_to_first_token_s: float
    tokens_per_s: float
    estimated: bool = False
    cached_tokens: int = 0  # of this turn's prompt tokens, how many the server's prefix cache supplied


@dataclass
class Retrying(Event):
    """The model request failed transiently and is retried; any partial output of it is discarded."""

    type: ClassVar[str] = "retrying"
    turn: int
    attempt: int
    delay_s: float
    reason: str


@dataclass
class Summarized(Event):
    """The context was summarised: a new trajectory segment starts."""

    type: ClassVar[str] = "summary"
    segment: int
    summary: str
    tokens_before: int
    tokens_after: int


@dataclass
class ModeChanged(Event):
    """The session's mode changed: code (tools as the approval mode allows), ask or plan (read-only)."""

    type: ClassVar[str] = "mode_changed"
    mode: str


POLICY_ERRORS = ("malformed_tool_call",)
"""Finished.error_kind values that are the model's own doing (it kept writing tool calls nothing could
parse): an episode ending in one is scored as a failure in evaluation and RL, not masked as infrastructure."""


@dataclass
class Finished(Event):
    """The run ended. status: completed | no_answer (the model's final answer was empty) | max_turns |
    max_time | max_tokens | error | interrupted."""

    type: ClassVar[str] = "finished"
    status: str
    final_text: str
    turns: int
    duration_s: float
    prompt_tokens: int
    completion_tokens: int
    session_id: str
    error: str | None = None
    # Why it failed, for scripts: the client's kind (config | server | request | cut_off | ...), the
    # loop's (malformed_tool_call), or a start-up failure's (unreachable | auth | not_found | usage |
    # session | internal); None otherwise.
    error_kind: str | None = None
    model_builtin: bool = False  # answered by the small built-in model: its claims are unverified


@dataclass
class Notice(Event):
    """Something the user should see that is not part of the conversation, e.g. an MCP server that did
    not start. level: info | warning | error."""

    type: ClassVar[str] = "notice"
    level: str
    text: str


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (SessionStarted, TurnStarted, TextDelta, ReasoningDelta, AssistantMessage, ToolCallStarted,
                ToolCallFinished, UsageReport, Retrying, Summarized, Finished, Notice, ModeChanged)
}


def event_from_json(line: str | dict[str, Any]) -> Event:
    data = json.loads(line) if isinstance(line, str) else dict(line)
    cls = EVENT_TYPES[data.pop("type")]
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def tool_call_message(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One entry of an assistant message's `tool_calls`."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
