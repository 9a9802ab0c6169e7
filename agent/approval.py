"""Approval modes: which tool calls run without asking.

  auto       everything runs (confined to the workspace by the tools themselves)
  read-only  tools that change files or run commands are refused with an observation the model can act on
  ask        those tools need the user's yes: once, always (for this tool, this session), or no with a reason

Front-ends supply `ask` (a blocking question to the user); the executor calls the approver from a
worker thread, so a front-end may block there until the user answers. The question comes with its
`Preview`, decided here once for every front-end: for edits, the diff the call will make to the file as
it is now, computed with the tool's own matching code and shown as the tool card shows it afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.render import Preview, approval_preview

if TYPE_CHECKING:  # front-ends import Decision at start-up; the tools package can load later
    from agent.tools import Tool, ToolCall, ToolContext

READ_ONLY_REFUSAL = (
    "Refused: this session is read-only, so {name} is not allowed. Continue with read-only tools "
    "(read_file, grep, glob, list_dir, lint, semantic_search) and describe the change you would make."
)


@dataclass
class Decision:
    answer: str  # "yes" | "always" | "no"
    reason: str = ""


Ask = Callable[["ToolCall", "Tool", dict[str, Any], Preview], Decision]


class Approvals:
    def __init__(self, mode: str, ask: Ask | None = None):
        if mode == "ask" and ask is None:
            raise ValueError("approval mode 'ask' needs a front-end that can ask")
        self.mode = mode
        self.ask = ask
        self.always: set[str] = set()
        self._lock = threading.Lock()  # one question at a time, even for parallel calls
        self.ctx: ToolContext | None = (
            None  # the tools' workspace, set by the controller: previews read files
        )

    def __call__(self, call: ToolCall, tool: Tool, args: dict[str, Any]) -> str | None:
        if not tool.mutates or self.mode == "auto":
            return None
        if self.mode == "read-only":
            return READ_ONLY_REFUSAL.format(name=tool.name)
        with self._lock:
            if tool.name in self.always:
                return None
            assert self.ask is not None
            decision = self.ask(call, tool, args, self.preview(tool.name, args))
        if decision.answer == "always":
            self.always.add(tool.name)
            return None
        if decision.answer == "yes":
            return None
        why = f" Their reason: {decision.reason}" if decision.reason.strip() else ""
        return f"The user declined this {tool.name} call.{why} Adjust your approach accordingly."

    def preview(self, name: str, args: dict[str, Any]) -> Preview:
        """What to show with the question about this call (read from the files as they are now)."""
        if self.ctx is None or name not in ("edit_file", "write_file"):
            return approval_preview(name, args)
        from agent.tools import ToolError  # lazily, as above

        try:
            diff, created = proposed_change(self.ctx, name, args)
        except ToolError as e:
            return approval_preview(name, args, error=str(e))
        except OSError as e:  # unreadable now: the question still goes out, with the arguments only
            return approval_preview(name, args, error=f"cannot read {args.get('path')}: {e.strerror}")
        return approval_preview(name, args, diff, created=created)


def proposed_change(ctx: ToolContext, name: str, args: dict[str, Any]) -> tuple[str, bool]:
    """(the unified diff an edit_file / write_file call would make, whether it creates the file), without
    writing anything. The new text comes from the tool's own code and the diff from the same function as
    the diff in its result, so the question and the card afterwards show the same lines."""
    from agent.tools import ToolError
    from agent.tools.edit_file import replaced
    from agent.tools.fileio import SNIFF_BYTES, decode, looks_binary, read_text, unified_diff

    real = ctx.workspace.resolve(str(args.get("path", "")), for_write=True)
    shown = ctx.workspace.display(real)
    exists = real.exists()
    if name == "write_file":
        raw = real.read_bytes() if real.is_file() else b""
        before = "" if looks_binary(raw[:SNIFF_BYTES]) else decode(raw).text
        return unified_diff(before, str(args.get("content", "")), shown), not exists
    old, new = str(args.get("old_string", "")), str(args.get("new_string", ""))
    if old == new:
        raise ToolError("old_string and new_string are identical; nothing would change")
    before = read_text(real, shown).text if exists or old else ""
    if not old:
        if before:
            raise ToolError(f"old_string is empty but {shown} already has content")
        return unified_diff("", new, shown), not exists
    after = replaced(before, shown, old, new, bool(args.get("replace_all", False))).after
    return unified_diff(before, after, shown), False
