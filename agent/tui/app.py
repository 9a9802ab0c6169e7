"""The Textual app: lays out the widgets, feeds them events, and calls the shared controller.

Threads: the controller (agent.interactive) is built, runs turns and runs slash commands in daemon
threads, so the UI thread only paints. Events come back through an EventPump (one flush per frame);
an approval question blocks the asking tool thread on an Event until the user answers here.
Start-up paints the input box first and connects to the model server afterwards, so typing can begin
at once; a task sent before the connection is up waits for it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import events
from textual.app import App
from textual.binding import Binding
from textual.containers import Horizontal
from textual.timer import Timer

from agent import history
from agent.approval import Ask, Decision
from agent.commands import Outcome, help_text
from agent.protocol import Event
from agent.render import Preview, Status
from agent.tui.approval import ApprovalBar
from agent.tui.cards import ToolCard
from agent.tui.feed import Feed
from agent.tui.panels import StatusBar, TodoPanel
from agent.tui.prompt import CompletionMenu, PromptArea
from agent.tui.pump import EventPump
from agent.tui.transcript import Transcript

if TYPE_CHECKING:  # the controller is imported on the connect thread, after the first paint
    from agent.interactive import Interactive

Connect = Callable[[Callable[[Event], None], Ask], "Interactive"]
WELCOME = "Composer — Enter sends · Esc interrupts · ↑ history · /help for commands · Ctrl+D quits"


@dataclass
class PendingApproval:
    call_id: str
    tool: str
    args: dict[str, Any]
    preview: Preview
    plan: bool = False  # the question is whether to carry out a plan, not about a tool call
    done: threading.Event = field(default_factory=threading.Event)
    decision: Decision = field(
        default_factory=lambda: Decision("no", "The interface closed before an answer.")
    )


class ComposerApp(App[int]):
    CSS_PATH = "composer.tcss"
    TITLE = "Composer"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("escape", "interrupt", show=False),
        Binding("ctrl+c", "ctrl_c", show=False, priority=True),
        Binding("ctrl+q", "quit", show=False, priority=True),
        Binding("ctrl+t", "toggle_todos", show=False),
        # Shift+Tab cycles the mode, as in other agents' apps (it no longer moves focus backwards).
        Binding("shift+tab", "cycle_mode", show=False, priority=True),
    ]

    def __init__(
        self,
        connect: Connect,
        *,
        root: Path,
        approval: str,
        clock: Callable[[], float] = time.monotonic,
        animate: bool = True,
    ):
        super().__init__()
        self.connect_fn, self.root, self.clock, self.animate = connect, root, clock, animate
        self.status = Status(approval=approval)
        self.feed = Feed(self)
        self.pump = EventPump(self.feed.apply)
        self.controller: Interactive | None = None
        self.connect_error: str | None = None
        self.busy = False
        self.turn_running = False
        self.queued: list[str] = []  # messages sent while a turn ran: they go out when it ends
        self.pending: PendingApproval | None = None
        self._worker: threading.Thread | None = None
        self._waiting: str | None = None  # a task sent before the connection was up
        self._ticker: Timer | None = None
        self._last_ctrl_c = 0.0
        self._closed = False
        self.history_file: Path | None = None  # found on the connect thread

    def compose(self):
        with Horizontal(id="main"):
            yield Transcript(id="transcript")
            yield TodoPanel(id="todos")
        yield ApprovalBar(id="approval")
        yield CompletionMenu(id="completions")
        yield PromptArea([], id="prompt")
        yield StatusBar(id="status")

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def prompt(self) -> PromptArea:
        return self.query_one(PromptArea)

    def on_mount(self) -> None:
        self.pump.attach(asyncio.get_running_loop(), self.set_timer)
        self.transcript.notice(WELCOME, "dim")
        self.prompt.focus()
        self.show_status()
        if self.animate:
            self.feed.start_spinner()
            self._ticker = self.set_interval(1.0, self.show_status, pause=True)
        self._start("connect", self._connect_work)

    # -- threads ----------------------------------------------------------------------------------

    def _start(self, name: str, work: Callable[[], None]) -> None:
        self._worker = threading.Thread(target=work, name=name, daemon=True)
        self._worker.start()

    @property
    def live(self) -> bool:
        """False from the moment shutdown starts: the widgets may already be gone."""
        return self.is_running and not self._closed

    def _to_ui(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run `callback` on the UI thread; a no-op once the app is shutting down or gone."""

        def guarded() -> Any:
            return callback(*args) if self.live else None

        try:
            self.call_from_thread(guarded)
        except RuntimeError:
            pass

    def _connect_work(self) -> None:
        if self.history_file is None:
            self.history_file = history.history_path(self.root)
            self._to_ui(self.prompt.load_history, history.load(self.history_file))
        try:
            controller = self.connect_fn(self.pump, self.ask)
            controller.files()  # warm the @ completion cache here rather than on the first keystroke
        except Exception as e:  # noqa: BLE001 - unreachable server, bad key, unknown session: shown, not fatal
            self._to_ui(self._connect_failed, str(e))
            return
        self._to_ui(self._connected, controller)
        import agent.tui.answer  # noqa: F401 - warm the Markdown widget (~70 ms) before the first answer

    def _connected(self, controller: Interactive) -> None:
        self.controller, self.connect_error = controller, None
        self.prompt.files = controller.files
        if controller.rt.resumed:
            self.transcript.replay(controller.transcript())
            self.transcript.notice(f"Resumed session {controller.rt.session.id}.", "dim")
        if self._waiting is not None:
            text, self._waiting = self._waiting, None
            self._run_turn(text)

    def _connect_failed(self, error: str) -> None:
        self.connect_error = error
        self._waiting = None
        self.transcript.notice(
            f"Cannot start the session: {error}\nSend a message to retry, or /exit.", "error"
        )
        self.status.model = "not connected"
        self.show_status()

    # -- input ------------------------------------------------------------------------------------

    def on_prompt_area_submitted(self, message: PromptArea.Submitted) -> None:
        text = message.text
        if self.turn_running and not text.strip().startswith("/"):
            history.append(self.history_file or history.history_path(self.root), text)
            self.queued.append(text)
            self.transcript.notice("Queued: it goes out when this turn ends (Esc puts it back here).", "dim")
            return
        if self.busy or self._waiting is not None:
            self.prompt.set_text(text)
            self.notify("A turn is running: press Esc to interrupt it first.", timeout=3)
            return
        history.append(self.history_file or history.history_path(self.root), text)
        if text.strip().startswith("/"):
            self._command(text.strip())
        elif self.controller is None:
            self.transcript.add_user(text)
            self._waiting = text
            if self.connect_error is not None:
                self.connect_error = None
                self.transcript.notice("Connecting…", "dim")
                self._start("connect", self._connect_work)
        else:
            self.transcript.add_user(text)
            self._run_turn(text)

    async def on_prompt_area_quit_requested(self) -> None:
        await self.action_quit()

    def _run_turn(self, text: str) -> None:
        controller = self.controller
        assert controller is not None
        self._set_busy(True)
        self.turn_running = True
        self.status.running_since = self.clock()

        def work() -> None:
            status = "error"
            try:
                finished = controller.run_turn(text)
                status = finished.status
                # A plan-mode turn that ended with a plan: asked here, as line mode and ACP ask it.
                plan = controller.plan_ready(finished)
                if plan and self._accepts_plan(plan):
                    status = controller.accept_plan().status
            except Exception as e:  # noqa: BLE001 - a bug must not leave the UI stuck busy
                self._to_ui(self._notice, f"Internal error: {type(e).__name__}: {e}", "error")
            finally:
                self._to_ui(self._turn_ended, status)

        self._start("turn", work)

    def _turn_ended(self, status: str) -> None:
        self.turn_running = False
        self._set_busy(False)
        queued, self.queued = self.queued, []
        if not queued:
            return
        text = "\n\n".join(queued)
        if status == "interrupted":  # the user stopped the agent: let them decide what to send next
            self.prompt.set_text(text)
            return
        self.transcript.add_user(text)
        self._run_turn(text)

    def _command(self, line: str) -> None:
        name = line.split()[0]
        if self.controller is None:
            out = {
                "/exit": Outcome("Bye.", exit=True),
                "/quit": Outcome("Bye.", exit=True),
                "/help": Outcome(help_text()),
            }.get(name, Outcome("Not connected to a model server yet.", error=True))
            self.call_later(self._outcome, out)
            return
        controller = self.controller
        self._set_busy(True)

        def work() -> None:
            try:
                out = controller.command(line)
            except Exception as e:  # noqa: BLE001
                out = Outcome(f"{name} failed: {type(e).__name__}: {e}", error=True)
            self._to_ui(self._outcome, out)
            self._to_ui(self._set_busy, False)

        self._start("command", work)

    async def _outcome(self, out: Outcome) -> None:
        if out.exit:
            await self.action_quit()
            return
        if out.clear:
            await self.pump.flush()  # the new session's SessionStarted must not land after the clear
            await self.transcript.clear()
            self.query_one(TodoPanel).show([])
        if out.replay:
            self.transcript.replay(out.replay)
        if out.text:
            self.transcript.notice(out.text, "error" if out.error else "info")

    def _notice(self, text: str, kind: str) -> None:
        self.transcript.notice(text, kind)

    def _set_busy(self, busy: bool) -> None:
        self.busy = busy
        if not busy:
            self.status.running_since = None
        if self._ticker is not None:
            self._ticker.resume() if busy else self._ticker.pause()
        self.show_status()

    def show_status(self) -> None:
        if not self.live:
            return
        self.query_one(StatusBar).show(self.status, self.clock(), self.busy)

    # -- approvals --------------------------------------------------------------------------------

    def ask(self, call: Any, tool: Any, args: dict[str, Any], preview: Preview) -> Decision:
        """The controller's approval callback: runs on a tool thread and blocks until answered."""
        return self._wait_for(PendingApproval(call.id, tool.name, args, preview))

    def _wait_for(self, pending: PendingApproval) -> Decision:
        if self._closed:
            return pending.decision
        try:
            self.call_from_thread(self._show_approval, pending)
        except RuntimeError:
            return pending.decision  # the app is gone
        while not pending.done.wait(0.25):
            if self._closed:  # never leave a tool thread waiting on an app that has exited
                break
        return pending.decision

    def _accepts_plan(self, todos: list[dict[str, Any]]) -> bool:
        """On the turn's thread: ask whether to carry out the plan; blocks until answered (no on quit)."""
        lines = [("dim" if t.get("status") == "completed" else "", f"• {t.get('content', '')}") for t in todos]
        pending = PendingApproval("", "plan", {}, Preview("Carry out this plan in code mode?", lines), plan=True)
        return self._wait_for(pending).answer == "yes"

    async def _show_approval(self, pending: PendingApproval) -> None:
        await self.pump.flush()  # make sure the call's card is on screen before asking about it
        self.pending = pending
        card = self.transcript.cards.get(pending.call_id)
        if card is not None:
            card.asking()
        self.query_one(ApprovalBar).ask(pending.tool, pending.preview, pending.plan)

    def on_approval_bar_answered(self, message: ApprovalBar.Answered) -> None:
        self._resolve(message.decision)

    def _resolve(self, decision: Decision) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        card = self.transcript.cards.get(pending.call_id)
        if card is not None:
            card.resume()
        self.query_one(ApprovalBar).close()
        self.prompt.focus()
        pending.decision = decision
        pending.done.set()

    # -- actions ----------------------------------------------------------------------------------

    async def on_event(self, event: events.Event) -> None:
        # Typing or pasting while a card or the transcript has the focus (after Tab or a click) goes to
        # the input box. The focus moves here, before the key is dispatched: moved from a handler (and
        # Widget.focus() is deferred besides), the keys already queued behind it (a paste, a fast
        # typist's Enter) would still go to the card, which took that Enter as "expand".
        if not event.is_forwarded and self._belongs_to_prompt(event):
            self.screen.set_focus(self.prompt)
        await super().on_event(event)

    def _belongs_to_prompt(self, event: events.Event) -> bool:
        typed = isinstance(event, events.Key) and event.is_printable and bool(event.character)
        if (
            not (typed or isinstance(event, events.Paste))
            or self.pending is not None
            or not self.screen_stack
        ):
            return False
        focused = self.focused
        if focused is self.prompt:
            return False
        return not (isinstance(focused, ToolCard) and isinstance(event, events.Key) and event.key == "space")

    def action_interrupt(self) -> None:
        if self.pending is not None:
            self._resolve(Decision("no", "The user interrupted the turn."))
        if self.busy and self.controller is not None:
            self.controller.interrupt()

    async def action_ctrl_c(self) -> None:
        if self.busy:
            self.action_interrupt()
        elif self.prompt.text:
            self.prompt.set_text("")
        elif self.clock() - self._last_ctrl_c < 1.5:
            await self.action_quit()
        else:
            self._last_ctrl_c = self.clock()
            self.notify("Press Ctrl+C again (or Ctrl+D) to quit.", timeout=1.5)

    def action_cycle_mode(self) -> None:
        if self.controller is None:
            return
        modes = ("code", "ask", "plan")
        following = modes[(modes.index(self.controller.mode) + 1) % len(modes)]
        self.notify(self.controller.command(f"/mode {following}").text, timeout=2)

    def action_toggle_todos(self) -> None:
        self.query_one(TodoPanel).toggle_class("-hidden")

    def on_unmount(self) -> None:
        self._closed = True
        if self.busy and self.controller is not None:
            self.controller.interrupt()

    async def action_quit(self) -> None:
        self._resolve(Decision("no", "The user quit."))
        if self.controller is not None:
            if self.busy:
                self.controller.interrupt()
                worker = self._worker
                if worker is not None:
                    await asyncio.to_thread(worker.join, 5)  # let the session record its end
            self.controller.close()
        self.exit(0)
