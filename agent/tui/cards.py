"""A tool call as a card: a spinner while it runs, one summary line when done, details on Enter/click.

The card only renders what agent.render decides from ToolCallStarted/ToolCallFinished; its colours
for diff and output kinds live in STYLES here.
"""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from agent.protocol import ToolCallFinished, ToolCallStarted
from agent.render import call_brief, detail_lines, human_seconds, result_summary

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
STYLES = {
    "add": "green", "remove": "red", "hunk": "cyan", "header": "bold", "context": "",
    "command": "bold", "output": "", "status": "dim", "error": "red", "hit": "",
    "completed": "dim strike", "in_progress": "bold", "pending": "",
}


def styled_lines(lines: list[tuple[str, str]]) -> Text:
    text = Text(no_wrap=False, overflow="fold")
    for i, (kind, line) in enumerate(lines):
        if i:
            text.append("\n")
        text.append(line, style=STYLES.get(kind, ""))
    return text


class ToolCard(Widget, can_focus=True):
    """One call. States: running → (waiting for approval → running) → ok | failed."""

    expanded: reactive[bool] = reactive(False)

    def __init__(self, event: ToolCallStarted):
        super().__init__(classes="-running")
        self.call_id = event.call_id
        self.tool = event.name
        self.brief = call_brief(event.name, event.arguments)
        self.finished: ToolCallFinished | None = None
        self.state = "running"  # running | asking | ok | failed | cancelled
        self.frame = 0
        # Children exist before mounting: events may change the card before it has composed.
        self.head = Static(self._head(), id="head", markup=False)
        self.body = Static("", id="body", markup=False)

    def compose(self):
        yield self.head
        yield self.body

    # -- state changes (called by the transcript) ---------------------------------------------------

    def tick(self, frame: int) -> None:
        self.frame = frame
        self.head.update(self._head())

    def asking(self) -> None:
        self._set_state("asking")

    def resume(self) -> None:
        if self.state == "asking":
            self._set_state("running")

    def finish(self, event: ToolCallFinished) -> None:
        self.finished = event
        self._set_state("ok" if event.ok else "failed")
        self.body.update(styled_lines(detail_lines(event)))

    def cancel(self) -> None:
        """The run ended without a result for this call (interrupted before it reported)."""
        if self.state in ("running", "asking"):
            self._set_state("cancelled")

    @property
    def running(self) -> bool:
        return self.state in ("running", "asking")

    def _set_state(self, state: str) -> None:
        self.remove_class(f"-{self.state}")
        self.state = state
        self.add_class(f"-{state}")
        self.head.update(self._head())

    # -- rendering ----------------------------------------------------------------------------------

    def _head(self) -> Text:
        icon, icon_style = {
            "running": (SPINNER[self.frame % len(SPINNER)], "yellow"),
            "asking": ("?", "bold magenta"), "ok": ("✓", "green"), "failed": ("✗", "red"),
            "cancelled": ("■", "dim"),
        }[self.state]
        tail = Text()
        if self.state == "asking":
            tail.append("  waiting for your answer", style="magenta")
        elif self.state == "cancelled":
            tail.append("  interrupted", style="dim")
        elif self.finished is not None:
            summary = result_summary(self.finished)
            tail.append(f"  {summary}", style="red" if self.state == "failed" else "dim")
            tail.append(f"  {human_seconds(self.finished.duration_s)}", style="dim")
            tail.append("  ▾" if self.expanded else "  ▸", style="dim")
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(f"{icon} ", style=icon_style)
        head.append(self.tool, style="bold")
        # The brief gives way first, so the outcome stays visible on narrow screens.
        room = (self.size.width or 100) - 2 - len(head) - len(tail)
        if self.brief and room > 3:
            head.append("  " + (self.brief if len(self.brief) <= room else self.brief[: room - 1] + "…"))
        return head + tail

    def on_resize(self) -> None:
        self.head.update(self._head())

    def watch_expanded(self, expanded: bool) -> None:
        self.set_class(expanded, "-expanded")
        self.head.update(self._head())

    def toggle(self) -> None:
        if self.finished is not None:
            self.expanded = not self.expanded

    def on_click(self, event: events.Click) -> None:
        self.toggle()

    def on_key(self, event: events.Key) -> None:
        if event.key in ("enter", "space"):
            event.stop()
            self.toggle()
