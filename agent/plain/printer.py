"""Line mode's output: events printed as they arrive, top to bottom, nothing ever redrawn.

Text streams straight through; each tool call gets one line when it starts and one when it ends
(with agent.render's summary), edits are followed by their unified diff. ANSI colour is used only
when the output is a colour-capable terminal and NO_COLOR is unset; without it the output is plain
text a log or a screen reader can take as is. Events come from several threads, so one lock orders
the writes; while an approval question is open, output is held back so it cannot garble the question.
"""

from __future__ import annotations

import os
import threading
from typing import TextIO

from agent.protocol import (
    AssistantMessage,
    Event,
    Finished,
    Notice,
    ReasoningDelta,
    Retrying,
    SessionStarted,
    Summarized,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from agent.render import (
    MAX_DETAIL_LINES,
    Status,
    call_brief,
    diff_lines,
    human_seconds,
    result_summary,
    run_notice,
)

ANSI = {"add": "32", "remove": "31", "hunk": "36", "header": "1", "dim": "2", "bold": "1", "error": "31",
        "ok": "32", "warning": "33", "tool": "36", "question": "1;35", "command": "1"}


def supports_colour(out: TextIO) -> bool:
    if os.environ.get("NO_COLOR") or os.environ.get("TERM", "") in ("", "dumb"):
        return False
    return hasattr(out, "isatty") and out.isatty()


class Printer:
    def __init__(self, out: TextIO, colour: bool, status: Status):
        self.out, self.colour, self.status = out, colour, status
        utf = (getattr(out, "encoding", "") or "").lower().replace("-", "").startswith("utf8")
        self.ok_mark, self.fail_mark, self.arrow = ("✓", "✗", "→") if utf else ("ok", "x", "->")
        self.lock = threading.RLock()
        self.at_line_start = True
        self.thinking_turn: int | None = None
        self.briefs: dict[str, str] = {}  # call id -> what the start line said, repeated at the end
        self._held: list[Event] | None = None

    # -- writing ----------------------------------------------------------------------------------

    def paint(self, text: str, kind: str) -> str:
        return f"\x1b[{ANSI[kind]}m{text}\x1b[0m" if self.colour and kind in ANSI and text else text

    def write(self, text: str) -> None:
        if not text:
            return
        with self.lock:
            self.out.write(text)
            self.out.flush()
            self.at_line_start = text.endswith("\n")

    def line(self, text: str = "", kind: str = "") -> None:
        """A whole line, starting on a fresh one."""
        with self.lock:
            self.write(("" if self.at_line_start else "\n") + self.paint(text, kind) + "\n")

    def lines(self, items: list[tuple[str, str]], indent: str = "    ") -> None:
        with self.lock:
            for kind, text in items:
                self.line(indent + text, kind)

    # -- approvals hold the output back -------------------------------------------------------------

    def hold(self) -> None:
        with self.lock:
            self._held = []

    def release(self) -> None:
        with self.lock:
            held, self._held = self._held or [], None
            for ev in held:
                self(ev)

    # -- events -----------------------------------------------------------------------------------

    def __call__(self, ev: Event) -> None:
        with self.lock:
            if self._held is not None:
                self._held.append(ev)
                return
            self.status.apply(ev)
            self._print(ev)

    def _print(self, ev: Event) -> None:
        if isinstance(ev, TextDelta):
            if self.thinking_turn is not None:
                self.thinking_turn = None
                self.line()
            self.write(ev.text)
        elif isinstance(ev, ReasoningDelta):
            if self.thinking_turn != ev.turn:
                self.thinking_turn = ev.turn
                self.line()
                self.write(self.paint("thinking: ", "dim"))
            self.write(self.paint(ev.text, "dim"))
        elif isinstance(ev, AssistantMessage):
            self.thinking_turn = None
            if not self.at_line_start:
                self.write("\n")
        elif isinstance(ev, ToolCallStarted):
            brief = self.briefs[ev.call_id] = call_brief(ev.name, ev.arguments)
            self.line(f"{self.paint(self.arrow, 'tool')} {self.paint(ev.name, 'bold')} {brief}")
        elif isinstance(ev, ToolCallFinished):
            self._finished_call(ev)
        elif isinstance(ev, (Retrying, Summarized, Finished, Notice)):
            self._run_notice(ev)
        elif isinstance(ev, SessionStarted) and ev.resumed:
            self.line(f"Resumed session {ev.session_id}.", "dim")
        elif isinstance(ev, SessionStarted):
            self._run_notice(ev)

    def _finished_call(self, ev: ToolCallFinished) -> None:
        mark = self.paint(self.ok_mark, "ok") if ev.ok else self.paint(self.fail_mark, "error")
        summary = result_summary(ev)
        brief = self.briefs.pop(ev.call_id, "")
        self.line(f"  {mark} {ev.name} {brief + ' · ' if brief else ''}"
                  f"{self.paint(summary, '' if ev.ok else 'error')} · {human_seconds(ev.duration_s)}")
        diff = (ev.data or {}).get("diff")
        if ev.name in ("edit_file", "write_file") and diff:
            self.lines(diff_lines(diff)[:MAX_DETAIL_LINES])

    def _run_notice(self, ev: Event) -> None:
        notice = run_notice(ev)
        if notice:
            kind, text = notice
            if isinstance(ev, Retrying):
                text += " The partial answer above is discarded."  # printed lines cannot be taken back
            self.line(text, "dim" if kind == "info" else kind)
        if isinstance(ev, Finished):
            parts = self.status.parts(0.0)[1:]  # the model's name was shown at start
            if parts:
                self.line("  " + " · ".join(p for p in parts if not p.startswith("approval")), "dim")
