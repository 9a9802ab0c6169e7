"""The status bar and the todo panel: both render state that agent.render keeps from events."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from agent.render import Status, todo_lines
from agent.tui.cards import STYLES


class StatusBar(Static):
    def show(self, status: Status, now: float, busy: bool) -> None:
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, part in enumerate(status.parts(now)):
            if i:
                text.append(" · ", style="dim")
            text.append(part, style="bold" if i == 0 else "")
        hint = "  Esc interrupts" if busy else "  /help"
        text.append(hint, style="dim")
        self.update(text)


class TodoPanel(Static):
    """The agent's plan from todo_write; hidden until there is one."""

    def show(self, todos: list[dict[str, Any]]) -> None:
        done = sum(t.get("status") == "completed" for t in todos)
        text = Text(f"Todos {done}/{len(todos)}\n", style="bold")
        for status, line in todo_lines(todos):
            text.append(line + "\n", style=STYLES.get(status, ""))
        self.update(text)
        self.set_class(bool(todos), "-visible")
