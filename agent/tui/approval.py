"""The approval question in `ask` mode: y once, a always (this tool, this session), n with a reason.

The same bar asks whether to carry out a plan a plan-mode turn ended with (`plan=True`): y or n only,
since neither "always" nor a reason means anything there."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import events
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Static

from agent.approval import Decision
from agent.render import Preview
from agent.tui.cards import styled_lines

KEYS_HINT = "[y] yes   [a] always for {tool} this session   [n] no, and say why   [Esc] stop the turn"
PLAN_HINT = "[y] yes, switch to code mode and carry it out   [n] no, keep planning"


class ApprovalBar(Vertical, can_focus=True):
    class Answered(Message):
        def __init__(self, decision: Decision):
            super().__init__()
            self.decision = decision

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.tool = ""
        self.plan = False

    def compose(self):
        yield Static("", id="question", markup=False)
        yield Static("", id="preview", markup=False)
        yield Static("", id="keys", markup=False)
        yield Input(placeholder="Why not? (optional; Enter sends)", id="reason")

    def ask(self, tool: str, preview: Preview, plan: bool = False) -> None:
        self.tool, self.plan = tool, plan
        question, lines = preview
        self.query_one("#question", Static).update(Text(question, style="bold"))
        self.query_one("#preview", Static).update(styled_lines(lines))
        self.query_one("#keys", Static).update(Text(PLAN_HINT if plan else KEYS_HINT.format(tool=tool),
                                                 style="dim"))
        reason = self.query_one("#reason", Input)
        reason.value = ""
        reason.display = False
        self.display = True
        self.focus()

    def close(self) -> None:
        self.display = False

    def on_key(self, event: events.Key) -> None:
        if self.query_one("#reason", Input).has_focus:
            return
        answer = {"y": "yes", "a": "always", "n": "no"}.get((event.character or "").lower())
        if answer is None or (self.plan and answer == "always"):
            return
        event.stop()
        if answer == "no" and not self.plan:
            reason = self.query_one("#reason", Input)
            reason.display = True
            reason.focus()
            return
        self.post_message(self.Answered(Decision(answer)))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.post_message(self.Answered(Decision("no", event.value.strip())))
