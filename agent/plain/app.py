"""Line mode's main loop: read a message, run it as a turn on a worker thread, answer approvals inline.

The main thread owns the terminal: it reads input, and while a turn runs it waits for approval
requests that tool threads queue (a tool thread cannot prompt by itself without two readers fighting
over stdin). Ctrl-C while a turn runs interrupts it (tools are killed, the session stays consistent);
a second Ctrl-C before it has stopped quits at once. At the prompt Ctrl-C clears the line, and twice
in a row on an empty line quits; Ctrl-D quits, at the prompt and at an approval question alike (the
question is declined and the turn stopped first, so no tool thread is left waiting). A question takes
one key: y, a or n.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.approval import Decision
from agent.client import ModelError
from agent.config import Config
from agent.interactive import Interactive, Outcome
from agent.plain.printer import Printer, supports_colour
from agent.plain.prompt import LineReader, Reader, dumb_terminal_session
from agent.protocol import Finished
from agent.render import Preview, Status, typed_text
from agent.session import SessionNotFound

EXIT_INTERRUPTED = 130
ANSWERS = {"y": "yes", "yes": "yes", "a": "always", "always": "always", "n": "no", "no": "no"}


@dataclass
class Question:
    tool: str
    args: dict[str, Any]
    preview: Preview
    done: threading.Event = field(default_factory=threading.Event)
    decision: Decision = field(default_factory=lambda: Decision("no", "The user interrupted the turn."))


class LineMode:
    def __init__(self, config: Config, root: Path, resume: str | None, mode: str | None = None):
        self.config, self.root, self.resume, self.mode = config, root, resume, mode
        self.out = sys.stdout
        self.colour = supports_colour(self.out)
        self.status = Status(approval=config.approval)
        self.printer = Printer(self.out, self.colour, self.status)
        self.questions: queue.Queue[Question] = queue.Queue()
        self.controller: Interactive | None = None
        self.reader: Reader | LineReader | None = None

    def ask(self, call: Any, tool: Any, args: dict[str, Any], preview: Preview) -> Decision:
        """The controller's approval callback (tool thread): queue the question for the main thread."""
        q = Question(tool.name, args, preview)
        self.questions.put(q)
        q.done.wait()
        return q.decision

    def run(self) -> int:
        try:
            self.controller = Interactive(
                self.config, self.root, emit=self.printer, ask=self.ask, resume=self.resume, mode=self.mode
            )
        except (ModelError, SessionNotFound) as e:
            print(f"composer-agent: error: {e}", file=sys.stderr)
            return 2
        c = self.controller
        if not sys.stdin.isatty() or not (hasattr(self.out, "isatty") and self.out.isatty()):
            # Piped input, or output going to a log: plain lines, no prompt redraws in the log.
            self.reader = LineReader(self.out)
            return self._session()
        with dumb_terminal_session() or nullcontext():
            self.reader = Reader(self.root, c.files, self.colour)
            return self._session()

    def _session(self) -> int:
        c = self.controller
        assert c is not None
        self.printer.line(
            f"Composer · {c.model_name} · approval: {self.config.approval} · "
            "/help for commands · Ctrl-D quits",
            "dim",
        )
        if c.rt.resumed:
            self._replay(c.transcript())
        try:
            return self._loop()
        finally:
            c.close()
            hint = c.resume_hint()
            if hint:
                self.printer.line(hint, "dim")

    def _loop(self) -> int:
        assert self.controller is not None and self.reader is not None
        last_ctrl_c = 0.0
        while True:
            try:
                text = self.reader.read()
            except EOFError:
                return 0
            except KeyboardInterrupt:
                if time.monotonic() - last_ctrl_c < 1.5:
                    return 0
                last_ctrl_c = time.monotonic()
                self.printer.line("(Ctrl-C again or Ctrl-D to quit)", "dim")
                continue
            if not text.strip():
                continue
            if text.strip().startswith("/"):
                out = self.controller.command(text.strip())
                self._show(out)
                if out.exit:
                    return 0
                continue
            if not self._turn(text):
                return 0

    def _show(self, out: Outcome) -> None:
        if out.clear:
            self.printer.line("— new conversation —", "dim")
        if out.replay:
            self._replay(out.replay)
        if out.text:
            self.printer.line(out.text, "error" if out.error else "")

    def _replay(self, messages: list[dict[str, Any]]) -> None:
        for m in messages:
            if m.get("role") == "user":
                self.printer.line("› " + typed_text(str(m.get("content") or "")), "bold")
            elif m.get("content"):
                self.printer.line(str(m["content"]))

    # -- a turn -----------------------------------------------------------------------------------

    def _turn(self, text: str) -> bool:
        """Run one turn, answering its approval questions; False when the user quit (Ctrl-D at a question).
        A plan-mode turn that ends with a plan is offered to carry out, in code mode."""
        controller = self.controller
        assert controller is not None
        finished: list[Finished] = []
        if not self._run(lambda: finished.append(controller.run_turn(text))):
            return False
        if finished and controller.plan_ready(finished[0]) and self._accepts_plan():
            return self._run(controller.accept_plan)
        return True

    def _accepts_plan(self) -> bool:
        assert self.reader is not None
        try:
            answer = self.reader.choose("Carry out this plan in code mode? [y]es, [n]o (keep planning): ", "yn")
        except (EOFError, KeyboardInterrupt):
            return False
        return answer.strip().lower().startswith("y")

    def _run(self, turn: Callable[[], object]) -> bool:
        """Run `turn` on a worker thread, answering its approval questions here; False when the user quit."""
        controller = self.controller
        assert controller is not None
        done = threading.Event()

        def work() -> None:
            try:
                turn()
            except Exception as e:  # noqa: BLE001 - report, keep the prompt alive
                self.printer.line(f"Internal error: {type(e).__name__}: {e}", "error")
            finally:
                done.set()

        threading.Thread(target=work, name="turn", daemon=True).start()
        interrupting = quitting = False
        while not done.is_set():
            current: Question | None = None
            try:
                try:
                    current = self.questions.get(timeout=0.1)
                except queue.Empty:
                    continue
                if quitting:  # the user has left: nobody is there to answer
                    current.done.set()
                    continue
                current.decision = self._approve(current)
                current.done.set()
            except EOFError:
                # Ctrl-D at a question quits, as at the prompt. The tool thread waiting for the answer
                # is told no, and the turn is stopped and waited for here: left blocked, the executor's
                # thread would hang the interpreter's exit.
                if current is not None:
                    current.done.set()
                quitting = True
                if not interrupting:
                    interrupting = True
                    controller.interrupt()
            except KeyboardInterrupt:
                if current is not None:
                    current.done.set()  # its default decision: no, interrupted
                if interrupting:
                    self.printer.line("Quitting.", "warning")
                    controller.close()
                    os._exit(EXIT_INTERRUPTED)
                interrupting = True
                self.printer.release()
                self.printer.line("Interrupting… (Ctrl-C again to quit)", "warning")
                controller.interrupt()
                self._decline_queued()
        self._decline_queued()
        return not quitting

    def _decline_queued(self) -> None:
        while True:
            try:
                self.questions.get_nowait().done.set()
            except queue.Empty:
                return

    def _approve(self, q: Question) -> Decision:
        assert self.reader is not None
        p = self.printer
        p.hold()  # other calls' output waits until the question is answered
        try:
            title, lines = q.preview
            with p.lock:
                p.line(f"? {title}", "question")
                p.lines(lines, "  ")
            hint = f"[y]es, [a]lways for {q.tool} this session, [n]o: "
            while True:
                answer = ANSWERS.get(self.reader.choose(hint, "yan").strip().lower())
                if answer:
                    break
            if answer != "no":
                return Decision(answer)
            reason = self.reader.answer("Why not? (optional, sent to the model): ").strip()
            return Decision("no", reason)
        finally:
            p.release()


def run(config: Config, root: Path, *, resume: str | None = None, mode: str | None = None) -> int:
    return LineMode(config, root, resume, mode).run()
