"""Our events (agent.protocol) as ACP `session/update`s: one function per event, no I/O.

A tool call becomes a `tool_call` when it starts (kind, title, locations, raw input) and one
`tool_call_update` when it finishes (status, the text the model saw, the edit as a diff, the command's
output). An edit's diff carries the file's whole text before and after, as ACP asks: `EditTexts` reads
the file when the call starts and again when it ends. That is exact because edits are exclusive in
the executor (nothing else runs while one does), and `on start` runs on the tool's own thread just
before it. The todo list is sent as the session's plan whenever todo_write changes it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from acp import (
    plan_entry,
    start_tool_call,
    text_block,
    tool_content,
    tool_diff_content,
    tool_terminal_ref,
    update_agent_message_text,
    update_agent_thought_text,
    update_plan,
    update_tool_call,
    update_user_message_text,
)
from acp.helpers import update_current_mode
from acp.schema import ToolCallLocation

from agent.protocol import Event, ModeChanged, ReasoningDelta, TextDelta, ToolCallFinished, ToolCallStarted

KINDS = {"read_file": "read", "list_dir": "read", "write_file": "edit", "edit_file": "edit", "grep": "search",
         "glob": "search", "semantic_search": "search", "shell": "execute", "lint": "execute",
         "todo_write": "think"}
EDITS = ("write_file", "edit_file")
MAX_OUTPUT_CHARS = 20_000  # what a tool card shows; the model saw all of it


def title(name: str, args: Any) -> str:
    """A tool call's one-line title, as the editor lists it."""
    a = args if isinstance(args, dict) else {}
    if name == "shell":
        return str(a.get("command", "shell")).splitlines()[0][:200] if a.get("command") else "shell"
    if name in ("read_file", "write_file", "edit_file", "list_dir", "lint"):
        verb = {"read_file": "Read", "write_file": "Write", "edit_file": "Edit", "list_dir": "List",
                "lint": "Lint"}[name]
        where = a.get("path") or ", ".join(a.get("paths") or []) or "."
        return f"{verb} {where}"
    if name in ("grep", "glob", "semantic_search"):
        return f"{name} {a.get('pattern') or a.get('query') or ''}".strip()
    if name == "todo_write":
        return "Update the plan"
    return name


def locations(root: Path, name: str, args: Any) -> list[ToolCallLocation]:
    a = args if isinstance(args, dict) else {}
    path = a.get("path")
    if not isinstance(path, str) or not path or name not in ("read_file", "write_file", "edit_file", "list_dir"):
        return []
    line = a.get("offset") if name == "read_file" and isinstance(a.get("offset"), int) else None
    return [ToolCallLocation(path=str((root / path).resolve()), line=line)]


class EditTexts:
    """The text of each edited file when its call started, keyed by call id (see the module docstring)."""

    def __init__(self, read):
        self.read = read  # Path -> str | None (None: no such file, or not text)
        self.before: dict[str, tuple[Path, str | None]] = {}
        self.lock = threading.Lock()

    def started(self, call_id: str, path: Path) -> None:
        with self.lock:
            self.before[call_id] = (path, self.read(path))

    def finished(self, call_id: str) -> tuple[Path, str | None, str | None] | None:
        with self.lock:
            got = self.before.pop(call_id, None)
        if got is None:
            return None
        path, old = got
        return path, old, self.read(path)


def to_updates(event: Event, root: Path, edits: EditTexts) -> list[Any]:
    """The ACP updates one event makes (often none: usage, turns and the like have no ACP form)."""
    if isinstance(event, TextDelta):
        return [update_agent_message_text(event.text)] if event.text else []
    if isinstance(event, ReasoningDelta):
        return [update_agent_thought_text(event.text)] if event.text else []
    if isinstance(event, ModeChanged):
        return [update_current_mode(event.mode)]
    if isinstance(event, ToolCallStarted):
        if event.name in EDITS and isinstance(event.arguments, dict) and isinstance(event.arguments.get("path"), str):
            edits.started(event.call_id, (root / event.arguments["path"]).resolve())
        return [start_tool_call(event.call_id, title(event.name, event.arguments), kind=KINDS.get(event.name, "other"),
                                status="in_progress", locations=locations(root, event.name, event.arguments),
                                raw_input=event.arguments)]
    if isinstance(event, ToolCallFinished):
        return _finished(event, edits)
    return []


def _finished(event: ToolCallFinished, edits: EditTexts) -> list[Any]:
    shown = event.content if len(event.content) <= MAX_OUTPUT_CHARS else (
        event.content[:MAX_OUTPUT_CHARS] + f"\n… [{len(event.content) - MAX_OUTPUT_CHARS} more characters]")
    # A command run in the editor's terminal stays shown as that terminal (its output is there, live
    # and after); the text would repeat it.
    tid = event.data.get("terminal_id")
    content = [tool_terminal_ref(tid)] if tid else [tool_content(text_block(shown))]
    change = edits.finished(event.call_id) if event.name in EDITS else None
    if change is not None and event.ok:
        path, old, new = change
        if new is not None and new != old:
            content.insert(0, tool_diff_content(str(path), new, old))
    raw = {"ok": event.ok, **{k: v for k, v in event.data.items() if k in ("exit_code", "diff", "path")}}
    out: list[Any] = [update_tool_call(event.call_id, status="completed" if event.ok else "failed",
                                       content=content, raw_output=raw)]
    todos = event.data.get("todos") if event.name == "todo_write" and event.ok else None
    if todos is not None:
        out.append(plan(todos))
    return out


def plan(todos: list[dict[str, Any]]):
    return update_plan([plan_entry(t["content"], status=t["status"]) for t in todos])


def replay(messages: list[dict[str, Any]]) -> list[Any]:
    """A saved conversation as updates, for session/load: what was said, and each tool call, finished."""
    out: list[Any] = []
    for m in messages:
        role, text = m.get("role"), m.get("content")
        if role == "user" and isinstance(text, str) and text:
            out.append(update_user_message_text(text))
        elif role == "assistant":
            if isinstance(text, str) and text:
                out.append(update_agent_message_text(text))
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function", {})
                out.append(start_tool_call(tc["id"], title(fn.get("name", ""), _args(fn.get("arguments"))),
                                           kind=KINDS.get(fn.get("name", ""), "other"), status="completed"))
    return out


def _args(raw: Any) -> Any:
    import json

    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw
