"""Approval modes: which tool calls run without asking.

  auto       everything runs (confined to the workspace by the tools themselves)
  read-only  tools that change files or run commands are refused with an observation the model can act on
  ask        those tools need the user's yes: once, always (for this tool, this session), or no with a reason

Front-ends supply `ask` (a blocking question to the user); the executor calls the approver from a
worker thread, so a front-end may block there until the user answers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # front-ends import Decision at start-up; the tools package can load later
    from agent.tools import Tool, ToolCall

READ_ONLY_REFUSAL = (
    "Refused: this session is read-only, so {name} is not allowed. Continue with read-only tools "
    "(read_file, grep, glob, list_dir, lint, semantic_search) and describe the change you would make."
)


@dataclass
class Decision:
    answer: str  # "yes" | "always" | "no"
    reason: str = ""


Ask = Callable[["ToolCall", "Tool", dict[str, Any]], Decision]


class Approvals:
    def __init__(self, mode: str, ask: Ask | None = None):
        if mode == "ask" and ask is None:
            raise ValueError("approval mode 'ask' needs a front-end that can ask")
        self.mode = mode
        self.ask = ask
        self.always: set[str] = set()
        self._lock = threading.Lock()  # one question at a time, even for parallel calls

    def __call__(self, call: ToolCall, tool: Tool, args: dict[str, Any]) -> str | None:
        if not tool.mutates or self.mode == "auto":
            return None
        if self.mode == "read-only":
            return READ_ONLY_REFUSAL.format(name=tool.name)
        with self._lock:
            if tool.name in self.always:
                return None
            assert self.ask is not None
            decision = self.ask(call, tool, args)
        if decision.answer == "always":
            self.always.add(tool.name)
            return None
        if decision.answer == "yes":
            return None
        why = f" Their reason: {decision.reason}" if decision.reason.strip() else ""
        return f"The user declined this {tool.name} call.{why} Adjust your approach accordingly."
