"""Agent events into widgets: the one place where agent.protocol meets the TUI's widgets.

`Feed.apply` receives the pump's per-frame batches; the spinner animates running cards from a single
timer that runs only while some card is running.
"""

from __future__ import annotations

from typing import Any, Protocol

from agent.protocol import (
    AssistantMessage,
    Event,
    ReasoningDelta,
    Retrying,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from agent.render import run_notice
from agent.tui.panels import TodoPanel


class FeedsApp(Protocol):
    """What the feed needs of agent/tui/app.py's ComposerApp (a protocol, so the two do not import each other)."""

    live: bool
    status: Any
    transcript: Any

    def query_one(self, selector: Any) -> Any: ...
    def set_interval(self, interval: float, callback: Any, *, pause: bool = False) -> Any: ...
    def show_status(self) -> None: ...


SPIN_S = 0.1


class Feed:
    def __init__(self, app: FeedsApp):
        self.app = app
        self.frame = 0
        self.spinner = None

    def start_spinner(self) -> None:
        self.spinner = self.app.set_interval(SPIN_S, self._spin, pause=True)

    async def apply(self, events: list[Event]) -> None:
        app = self.app
        if not app.live:
            return
        t = app.transcript
        status_changed = False
        for ev in events:
            status_changed |= app.status.apply(ev)
            if isinstance(ev, TextDelta):
                await t.text(ev.turn, ev.text)
            elif isinstance(ev, ReasoningDelta):
                t.reasoning(ev.turn, ev.text)
            elif isinstance(ev, AssistantMessage):
                await t.end_text(ev.turn)
            elif isinstance(ev, ToolCallStarted):
                t.tool_started(ev)
                if self.spinner is not None:
                    self.spinner.resume()
            elif isinstance(ev, ToolCallFinished):
                t.tool_finished(ev)
                if ev.name == "todo_write" and ev.ok:
                    app.query_one(TodoPanel).show(ev.data.get("todos") or [])
            elif isinstance(ev, Retrying):
                await t.discard_turn_output(ev.turn)  # the loop throws the partial answer away too
            if ev.type == "finished":
                await t.end_run()
            notice = run_notice(ev)
            if notice:
                kind, text = notice
                t.notice(text, "dim" if kind == "info" else kind)
        t.follow()
        if status_changed:
            app.show_status()

    def _spin(self) -> None:
        if not self.app.live:
            return
        self.frame += 1
        cards = self.app.transcript.running_cards()
        for card in cards:
            card.tick(self.frame)
        if not cards and self.spinner is not None:
            self.spinner.pause()
