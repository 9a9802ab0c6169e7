"""Reading the user's input in line mode: a prompt-toolkit prompt, or plain lines when stdin is a pipe.

The prompt keeps history in `.composer/history` (agent.history, the file the TUI uses too), edits
several lines (Enter sends; Ctrl+J or Alt+Enter adds a line) and completes `/` commands and `@`
mentions from agent.completion while typing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.application.current import get_app
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.filters import Condition
from prompt_toolkit.formatted_text import ANSI
from prompt_toolkit.history import History
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.output.vt100 import Vt100_Output
from prompt_toolkit.utils import is_dumb_terminal

from agent import history
from agent.completion import suggest


class FileHistory(History):
    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def load_history_strings(self) -> Iterable[str]:
        return reversed(history.load(self.path))  # prompt-toolkit wants the newest first

    def store_string(self, string: str) -> None:
        history.append(self.path, string)


class CommandsAndMentions(Completer):
    def __init__(self, files: Callable[[], list[str]]):
        self.files = files

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterable[Completion]:
        replace_len, found = suggest(document.text_before_cursor, self.files)
        for s in found:
            yield Completion(s.text, start_position=-replace_len, display=s.label, display_meta=s.meta)


def _bindings() -> KeyBindings:
    kb = KeyBindings()

    @kb.add("c-j")
    @kb.add("escape", "enter")
    def _(event) -> None:
        event.current_buffer.insert_text("\n")

    return kb


class QuietOutput(Vt100_Output):
    """For dumb terminals: prompt-toolkit still shows/hides the cursor there; those escapes would be
    noise in a log or a screen reader, and a dumb terminal has no cursor to show."""

    def show_cursor(self) -> None:
        pass

    def hide_cursor(self) -> None:
        pass


def dumb_terminal_session():
    """An app session whose output sends no escapes; prompt-toolkit keeps its dumb-terminal prompt
    because the output is not passed to PromptSession itself. None on a real terminal."""
    if not is_dumb_terminal():
        return None
    from prompt_toolkit.application.current import create_app_session

    return create_app_session(output=QuietOutput.from_pty(sys.stdout, term="dumb"))


class Reader:
    """prompt-toolkit on a terminal. `read` raises EOFError on Ctrl-D, KeyboardInterrupt on Ctrl-C."""

    def __init__(self, root: Path, files: Callable[[], list[str]], colour: bool):
        self.colour = colour
        self.session: PromptSession[str] = PromptSession(
            history=FileHistory(history.history_path(root)), completer=CommandsAndMentions(files),
            complete_while_typing=True, key_bindings=_bindings(), multiline=False,
            prompt_continuation="… ", enable_open_in_editor=False)
        self.answers: PromptSession[str] = PromptSession()

    def _message(self, text: str, code: str) -> ANSI | str:
        return ANSI(f"\x1b[{code}m{text}\x1b[0m") if self.colour else text

    def read(self) -> str:
        return self.session.prompt(self._message("› ", "1"))

    def answer(self, question: str) -> str:
        return self.answers.prompt(self._message(question, "1;35"))

    def choose(self, question: str, keys: str) -> str:
        """A question answered by one key: any of `keys` typed on an empty line answers at once, as in
        the full-screen app (a whole word and Enter still works). Ctrl-D and Ctrl-C raise as in `read`."""
        return self.answers.prompt(self._message(question, "1;35"), key_bindings=_one_key(keys))


def _one_key(keys: str) -> KeyBindings:
    kb = KeyBindings()
    empty = Condition(lambda: not get_app().current_buffer.text)
    for key in keys:
        @kb.add(key, filter=empty)
        def _(event, key=key) -> None:
            event.current_buffer.text = key  # left on screen, so the answer given stays visible
            event.app.exit(result=key)

    return kb


class LineReader:
    """Stdin is not a terminal (a pipe, a file): one line per message, answers read the same way."""

    def __init__(self, out=sys.stdout):
        self.out = out

    def read(self) -> str:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def answer(self, question: str) -> str:
        self.out.write(question)
        self.out.flush()
        return self.read()

    def choose(self, question: str, keys: str) -> str:
        return self.answer(question)  # lines from a pipe: each answer ends with its newline anyway
