"""What the input box offers to complete: slash commands at the start, `@` file mentions anywhere.

Pure and shared by the TUI's popup and line mode's prompt-toolkit completer, so both offer exactly
the same candidates from the one COMMANDS list and the same fuzzy file ranking.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from agent.commands import COMMANDS

# An @ that starts a word, and the path characters typed after it so far (MENTION's alphabet).
PARTIAL_MENTION = re.compile(r"(?<![\w@])@([\w.\-/~+]*)$")
MAX_SUGGESTIONS = 12


@dataclass(frozen=True)
class Suggestion:
    text: str  # what replaces the token being completed
    label: str  # what the menu shows
    meta: str = ""  # a dim hint beside it


def suggest(before_cursor: str, files: Callable[[], list[str]],
            limit: int = MAX_SUGGESTIONS) -> tuple[int, list[Suggestion]]:
    """(length of the token before the cursor to replace, suggestions); (0, []) when none apply.

    `files` is called only when an @ mention is being typed (listing files can cost a git call)."""
    if before_cursor.startswith("/") and not any(c.isspace() for c in before_cursor):
        found = [Suggestion(c.name + (" " if c.args else ""), f"{c.name} {c.args}".strip(), c.help)
                 for c in COMMANDS if c.name.startswith(before_cursor)
                 and not (c.name == before_cursor and not c.args)]  # nothing left to complete
        return len(before_cursor), found[:limit]
    m = PARTIAL_MENTION.search(before_cursor)
    if m:
        from agent.mentions import complete  # lazily: it pulls in the tools package
        found = [Suggestion(f"@{path} ", path) for path in complete(m.group(1), files(), limit=limit)]
        return len(m.group(0)), found
    return 0, []
