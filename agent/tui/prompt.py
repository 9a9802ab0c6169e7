"""The input box: multi-line editing, history on ↑/↓, completion of @ mentions and / commands.

Enter sends; Ctrl+J, Alt+Enter (and Shift+Enter where the terminal reports it) insert a new line.
↑ on the first line and ↓ on the last walk the history, as in a shell; elsewhere they move the cursor.
What to suggest comes from agent.completion (shared with line mode); this file only shows it.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual import events
from textual.message import Message
from textual.widgets import OptionList, TextArea
from textual.widgets.option_list import Option

from agent.completion import Suggestion, suggest
from agent.history import Cursor

PLACEHOLDER = "Ask Composer…   @ mentions a file · / for commands · Ctrl+J new line"
NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")


class CompletionMenu(OptionList, can_focus=False):
    """Suggestions under the cursor's token; the prompt keeps the focus and drives it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.suggestions: list[Suggestion] = []
        self.replace_len = 0

    def show(self, replace_len: int, suggestions: list[Suggestion]) -> None:
        self.suggestions, self.replace_len = suggestions, replace_len
        self.clear_options()
        self.add_options([Option(Text.assemble(s.label, ("  " + s.meta if s.meta else "", "dim")))
                          for s in suggestions])
        self.highlighted = 0
        self.display = True

    def hide(self) -> None:
        self.display = False
        self.suggestions = []

    def current(self) -> Suggestion | None:
        if self.highlighted is None or not self.suggestions:
            return None
        return self.suggestions[self.highlighted]


class PromptArea(TextArea):
    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    class QuitRequested(Message):
        pass

    def __init__(self, history: list[str], **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         placeholder=PLACEHOLDER, **kw)
        self.past = Cursor(history)  # not `history`: TextArea uses that name for undo
        self.files: Callable[[], list[str]] = list  # set once the controller is connected
        self._quiet = False  # text set by history: do not pop the menu up
        self._dismissed: str | None = None  # the text at which the user closed the menu with Esc

    def load_history(self, entries: list[str]) -> None:
        """History arrives after the first paint (reading it is not worth delaying the input box)."""
        self.past = Cursor(entries + self.past.entries)  # anything sent meanwhile stays the newest

    @property
    def menu(self) -> CompletionMenu:
        return self.screen.query_one(CompletionMenu)

    def set_text(self, text: str) -> None:
        self._quiet = text != self.text  # an unchanged text posts no Changed event to clear the flag
        self.load_text(text)
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        key = event.key
        handled = True
        menu = self.menu
        if menu.display and key in ("up", "down", "tab", "enter", "escape"):
            if key == "up":
                menu.action_cursor_up()
            elif key == "down":
                menu.action_cursor_down()
            elif key == "escape":
                self._dismissed = self.text
                menu.hide()
            elif not self._catch_up(menu) and key == "enter":
                menu.hide()  # the typing had already finished the token: Enter sends, as it would have
                self._submit()
            else:
                self._accept(menu.current())
        elif key == "enter":
            self._submit()
        elif key in NEWLINE_KEYS:
            self.insert("\n")
        elif key == "up" and self.cursor_location[0] == 0 and self.selection.is_empty:
            entry = self.past.older(self.text)
            if entry is not None:
                self.set_text(entry)
        elif key == "down" and self.cursor_location[0] == self.document.line_count - 1 and self.selection.is_empty:
            entry = self.past.newer()
            if entry is not None:
                self.set_text(entry)
        elif key == "ctrl+d" and not self.text:
            self.post_message(self.QuitRequested())
        else:
            handled = False
        if handled:
            event.stop()
            event.prevent_default()  # TextArea's own handler must not also insert or move

    def _submit(self) -> None:
        text = self.text
        if text.strip():
            self.past.add(text)
            self.post_message(self.Submitted(text))
            self.set_text("")

    def _catch_up(self, menu: CompletionMenu) -> bool:
        """Bring the menu up to the text as it is now, before a key acts on it: keys typed fast reach us
        before the Changed events of the ones before them, so the menu can still hold the suggestions
        (and the token length) of an earlier prefix, and accepting them would paste over what was typed
        since (`/undo` + Enter became `/u/undo`). Keeps the highlighted choice if it still applies.
        False when nothing is left to complete."""
        before = self.get_text_range((0, 0), self.cursor_location)
        replace_len, found = suggest(before, self.files)
        if not found:
            return False
        current = menu.current()
        menu.show(replace_len, found)
        texts = [s.text for s in found]
        if current is not None and current.text in texts:
            menu.highlighted = texts.index(current.text)
        return True

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if self._quiet:
            self._quiet = False
            self.menu.hide()
            return
        if self._dismissed is not None and self.text != self._dismissed:
            self._dismissed = None
        self.refresh_menu()

    def refresh_menu(self) -> None:
        if self._dismissed is not None:
            return
        before = self.get_text_range((0, 0), self.cursor_location)
        replace_len, found = suggest(before, self.files)
        if found:
            self.menu.show(replace_len, found)
        else:
            self.menu.hide()

    def _accept(self, choice: Suggestion | None) -> None:
        menu = self.menu
        if choice is None:
            menu.hide()
            return
        row, col = self.cursor_location
        self.replace(choice.text, (row, col - menu.replace_len), (row, col))
        menu.hide()
        self._dismissed = self.text  # until the next keystroke changes it
