"""The slash commands and keys of the interactive interfaces: one definition for the TUI, line mode,
completion and /help. Pure data, cheap to import (the input box needs it before anything else)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Command:
    name: str
    args: str
    help: str


COMMANDS = [
    Command("/help", "", "show commands and keys"),
    Command("/clear", "", "start a new conversation (a new session)"),
    Command("/model", "[NAME]", "show the model, or switch to NAME"),
    Command("/mode", "[code|ask|plan]", "show the mode, or switch: ask and plan only read"),
    Command("/resume", "[ID|last]", "list recent sessions, or continue one"),
    Command("/index", "[--rebuild]", "build or refresh the semantic search index"),
    Command("/compact", "", "summarise the conversation now to free context"),
    Command("/undo", "", "restore the files the last turn changed"),
    Command("/exit", "", "quit"),
]
KEYS = [("Enter", "send"), ("Ctrl+J / Alt+Enter", "new line"), ("Up / Down", "history"),
        ("@", "mention a file (Tab completes)"), ("Ctrl+C", "interrupt the running turn (also Esc full-screen)"),
        ("Ctrl+D", "quit (on an empty line)")]


def help_text() -> str:
    width = max([len(f"{c.name} {c.args}".strip()) for c in COMMANDS] + [len(k) for k, _ in KEYS])
    lines = ["Commands:"] + [f"  {f'{c.name} {c.args}'.strip():<{width}}  {c.help}" for c in COMMANDS]
    lines += ["Keys:"] + [f"  {k:<{width}}  {v}" for k, v in KEYS]
    return "\n".join(lines)


@dataclass
class Outcome:
    """What a slash command did, for the front-end to show."""

    text: str = ""
    exit: bool = False
    clear: bool = False  # the transcript starts over
    replay: list[dict[str, Any]] = field(default_factory=list)  # a resumed conversation to show
    error: bool = False
