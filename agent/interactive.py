"""What the interactive front-ends share: slash commands, turns with checkpoints and @mentions.

The TUI and the line-mode interface are views: they render agent.protocol events and call this
controller; neither holds logic of its own. `run_turn` blocks (front-ends call it from a worker
thread); `interrupt` may be called from any thread. Slash commands are defined once, in
agent.commands (light, so input boxes can complete them before the controller is loaded).
"""

from __future__ import annotations

import io
import shlex
import time
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace
from pathlib import Path

from agent.approval import Approvals, Ask
from agent.checkpoint import CheckpointError, Checkpoints
from agent.client import Model, ModelError, OpenAIClient
from agent.commands import COMMANDS, KEYS, Command, Outcome, help_text  # noqa: F401 - re-exported
from agent.config import Config
from agent.mentions import expand, repo_files
from agent.protocol import Event, Finished, Message
from agent.runtime import Runtime, build, sessions_dir
from agent.session import SessionNotFound, load


class Interactive:
    def __init__(
        self,
        config: Config,
        root: Path,
        *,
        emit: Callable[[Event], None],
        ask: Ask | None = None,
        model: Model | None = None,
        resume: str | None = None,
        mode: str | None = None,
    ):
        self.config, self.root, self.emit, self.ask = config, root, emit, ask
        self.mode = "code"  # kept here too: /clear builds a new agent in the same mode
        self._given_model = model
        self.approvals = Approvals(config.approval, ask)
        self.rt: Runtime = self._build(resume, mode)
        self.checkpoints = Checkpoints(root)
        self._note = ""
        self._files: list[str] | None = None
        self.turn_started_at: float | None = None

    def _build(self, resume: str | None, mode: str | None = None) -> Runtime:
        """`mode`: the one asked for (--mode); without it a resumed session keeps its recorded mode and
        a new one (/clear) the current mode."""
        rt = build(
            self.config,
            self.root,
            emit=self.emit,
            approve=self.approvals,
            resume=resume,
            model=self._given_model,
        )
        self.approvals.ctx = rt.agent.ctx  # approval previews diff against the files the tools see
        rt.agent.set_mode(mode or (rt.agent.mode if resume else self.mode))
        self.mode = rt.agent.mode
        return rt

    # -- turns ----------------------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.rt.model.name

    def files(self, refresh: bool = False) -> list[str]:
        """Candidates for @ completion (cached; refreshed after each turn)."""
        if self._files is None or refresh:
            self._files = repo_files(self.root)
        return self._files

    def run_turn(self, text: str) -> Finished:
        """Run one user turn to completion (blocking). Files are checkpointed first for /undo."""
        expanded, _ = expand(text, self.rt.agent.ctx)
        if self._note:
            expanded, self._note = f"{self._note}\n\n{expanded}", ""
        try:
            self.checkpoints.snapshot(text[:72])
        except CheckpointError:
            pass  # no git binary or an unwritable workspace: the turn still runs, /undo will say so
        self.turn_started_at = time.monotonic()
        try:
            return self.rt.agent.run(expanded, self.rt.system)
        finally:
            self.turn_started_at = None
            self._files = None

    def interrupt(self) -> None:
        self.rt.agent.interrupt()

    def close(self) -> None:
        self.rt.session.close()

    def resume_hint(self) -> str | None:
        """The command that continues this conversation later; None when nothing was said in it."""
        session = self.rt.session
        if not any(session.counts.values()):
            return None
        # Sessions live under the workspace: from another folder the command needs --cwd to find it.
        where = "" if self.root == Path.cwd().resolve() else f" --cwd {shlex.quote(str(self.root))}"
        return f"To continue this session: composer-agent{where} --resume {session.id}"

    # -- slash commands -------------------------------------------------------------------------------

    def command(self, line: str) -> Outcome:
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        handler = {
            "/help": lambda: Outcome(help_text()),
            "/exit": lambda: Outcome("Bye.", exit=True),
            "/quit": lambda: Outcome("Bye.", exit=True),
            "/clear": self._clear,
            "/model": lambda: self._model(arg),
            "/mode": lambda: self._mode(arg),
            "/resume": lambda: self._resume(arg),
            "/index": lambda: self._index(arg),
            "/compact": self._compact,
            "/undo": self._undo,
        }.get(name)
        if handler is None:
            return Outcome(f"Unknown command {name}. Type /help for the list.", error=True)
        try:
            return handler()
        except (ModelError, SessionNotFound, CheckpointError, ValueError) as e:
            return Outcome(str(e), error=True)

    def _clear(self) -> Outcome:
        self.rt.session.close()
        self.rt = self._build(None)
        self.checkpoints.stack.clear()
        return Outcome(f"New session {self.rt.session.id}.", clear=True)

    def _model(self, name: str) -> Outcome:
        if not name:
            return Outcome(f"Model: {self.model_name} at {self.config.base_url}")
        client = OpenAIClient(replace(self.config, model=name))
        client.check()
        self.rt.agent.model = self.rt.model = client
        self.config = replace(self.config, model=name)
        return Outcome(f"Switched to {name}.")

    def _mode(self, name: str) -> Outcome:
        if not name:
            return Outcome(f"Mode: {self.mode} (/mode code|ask|plan; ask and plan write no file and run no command)")
        self.rt.agent.set_mode(name)
        self.mode = name
        return Outcome(f"Mode: {name}.")

    def plan_ready(self, finished: Finished) -> list[dict]:
        """The plan a plan-mode turn ended with, for the front-end to offer to carry out."""
        return self.rt.agent.plan_ready(finished)

    def accept_plan(self) -> Finished:
        """Switch to code and carry out the plan (blocking, like run_turn)."""
        task = self.rt.agent.accept_plan()
        self.mode = "code"
        return self.run_turn(task)

    def _resume(self, which: str) -> Outcome:
        if not which:
            return Outcome(self.recent_sessions())
        self.rt.session.close()
        self.rt = self._build(which)
        self.checkpoints.stack.clear()
        return Outcome(f"Resumed session {self.rt.session.id}.", clear=True, replay=self.transcript())

    def transcript(self) -> list[Message]:
        """The conversation so far as a front-end replays it: user and assistant messages."""
        return [m for m in self.rt.agent.messages if m.get("role") in ("user", "assistant")]

    def recent_sessions(self, n: int = 10) -> str:
        folder = sessions_dir(self.root)
        files = sorted(folder.glob("*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True)[:n]
        if not files:
            return "No saved sessions yet."
        lines = ["Recent sessions (/resume ID):"]
        for path in files:
            data = load(path)
            first = next((m["content"] for m in data.messages if m.get("role") == "user"), "")
            lines.append(f"  {path.stem}  {str(first).splitlines()[0][:60] if first else '(empty)'}")
        return "\n".join(lines)

    def _index(self, arg: str) -> Outcome:
        try:
            import index.cli as index_cli
        except ImportError:
            return Outcome("Semantic search is not installed (pip install -e '.[index]').", error=True)
        out = io.StringIO()
        with redirect_stdout(out), redirect_stderr(out):
            code = index_cli.main_index(arg.split() if arg else [], self.root)
        return Outcome(out.getvalue().strip() or "Index is up to date.", error=code != 0)

    def _compact(self) -> Outcome:
        if not self.rt.agent.compact():
            return Outcome("Nothing to compact yet.")
        return Outcome("Conversation summarised.")

    def _undo(self) -> Outcome:
        changed = self.checkpoints.undo()
        if not changed:
            return Outcome("The last turn changed no files.")
        self._note = (
            "(The user undid the file changes of the previous turn: " + ", ".join(changed[:20]) + ".)"
        )
        return Outcome("Restored: " + ", ".join(changed))
