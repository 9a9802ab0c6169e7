"""edit_file: replace a unique string in a file, robustly, without disturbing anything else.

The file's encoding, BOM, line endings, final newline and mode survive the edit; the write is atomic.
Matching is exact first, then tolerant tiers (see edit_match) accepted only when unique. Errors leave
the file untouched and tell the model what to do next: the line numbers of every match when several
match, the closest region when none does.
"""

from __future__ import annotations

from typing import NamedTuple

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext
from agent.tools.edit_match import Ambiguous, Found, closest_region, find, line_of
from agent.tools.fileio import atomic_write, read_for_edit, read_text, save, unified_diff
from agent.tools.lint import introduced_problems_note

SNIPPET_CONTEXT = 3
MAX_SNIPPET_LINES = 40

TIER_NOTES = {
    "exact": "matched exactly",
    "line_endings": "matched after normalising line endings (CRLF/LF)",
    "trailing_whitespace": "matched ignoring trailing whitespace",
    "indentation": "matched with different indentation; new_string was re-indented to fit",
    "unicode": "matched after folding typographic quotes/dashes/spaces to ASCII",
    "whitespace": "matched ignoring all whitespace differences",
}


@tool(parallel_safe=False, mutates=True)
def edit_file(ctx: ToolContext, path: str, old_string: str, new_string: str, replace_all: bool = False) -> ToolResult:
    """Replace `old_string` with `new_string` in a file. `old_string` must match one place in the file
    (include a few surrounding lines to make it unique) unless `replace_all` is true. Copy `old_string`
    from the file's text without the line-number prefix that read_file shows. An empty `old_string`
    creates a new file containing `new_string`. Python edits are linted and new errors are reported.

    Args:
        path: File to edit, relative to the workspace root.
        old_string: The exact text to replace (whole lines recommended, indentation included).
        new_string: The text to put in its place.
        replace_all: Replace every occurrence instead of requiring a unique match.
    """
    real = ctx.workspace.resolve(path, for_write=True)
    shown = ctx.workspace.display(real)
    if old_string == new_string:
        raise ToolError("old_string and new_string are identical; nothing would change")
    if old_string == "":
        return _create(ctx, real, shown, new_string)
    tf = read_for_edit(real, shown, ctx.editor)
    before = tf.text
    after, work, found, tier = replaced(before, shown, old_string, new_string, replace_all)
    save(real, tf, after, ctx.workspace.temp_dir(), ctx.editor)

    first_line = line_of(work, found.matches[0].start)
    count = len(found.matches)
    msg = (f"Edited {shown}: {count} replacement{'s' if count > 1 else ''} "
           f"(first at line {first_line}; {TIER_NOTES[tier]}).")
    snippet = _snippet(after.replace("\r\n", "\n"), first_line, found.matches[0].replacement)
    lint_note, problems = introduced_problems_note(before, after, shown)
    diff = unified_diff(before, after, shown)
    return ToolResult(msg + "\n" + snippet + lint_note, data={
        "path": shown, "tier": tier, "replacements": count, "diff": diff, "first_line": first_line,
        "lint_errors": problems,
    })


class Replaced(NamedTuple):
    after: str  # the file's new text, in the file's own line endings
    work: str  # the old text as matched (LF when the file is CRLF throughout)
    found: Found
    tier: str


def replaced(before: str, shown: str, old_string: str, new_string: str, replace_all: bool = False) -> Replaced:
    """The file's text after the edit, without writing it: the tool and its approval preview share it,
    so the question shows exactly the change that will be made. ToolError when old_string does not match."""
    crlf_file = "\r\n" in before and before.count("\r\n") == before.count("\n")
    work = before.replace("\r\n", "\n") if crlf_file else before
    old_lf, new_lf = old_string.replace("\r\n", "\n"), new_string.replace("\r\n", "\n")
    try:
        found = find(work, old_lf, new_lf, replace_all)
        if found is None and not crlf_file and "\r\n" in before:
            # A file with mixed endings: try the CRLF spelling of old_string as is.
            found = find(work, old_lf.replace("\n", "\r\n"), new_lf.replace("\n", "\r\n"), replace_all)
    except Ambiguous as e:
        raise ToolError(_ambiguous_message(shown, e)) from None
    if found is None:
        raise ToolError(_no_match_message(shown, work, old_lf))
    tier = found.tier
    if tier == "exact" and old_string not in before:
        tier = "line_endings"
    pieces, last = [], 0
    for m in found.matches:
        pieces += [work[last : m.start], m.replacement]
        last = m.end
    after = "".join(pieces) + work[last:]
    after = _keep_final_newline(work, after)
    if crlf_file:
        after = after.replace("\n", "\r\n")
    return Replaced(after, work, found, tier)


def _create(ctx: ToolContext, real, shown: str, content: str) -> ToolResult:
    if real.is_dir():
        raise ToolError(f"{shown} is a directory")
    if real.exists():
        tf = read_text(real, shown)
        if tf.text:
            raise ToolError(
                f"old_string is empty but {shown} already has content. To insert text, put a nearby "
                "unique line in old_string and repeat it in new_string with your addition; to replace the "
                "whole file, use write_file."
            )
        atomic_write(real, tf.encode(content), mode=tf.mode, tmp_dir=ctx.workspace.temp_dir())
    else:
        atomic_write(real, content.encode("utf-8"), tmp_dir=ctx.workspace.temp_dir())
    lint_note, problems = introduced_problems_note(None, content, shown)
    lines = content.count("\n") + (0 if content.endswith("\n") or not content else 1)
    return ToolResult(f"Created {shown} ({lines} lines).{lint_note}",
                      data={"path": shown, "tier": "create", "diff": unified_diff("", content, shown),
                            "lint_errors": problems})


def _keep_final_newline(before: str, after: str) -> str:
    if not after or not before:
        return after
    if before.endswith("\n") and not after.endswith("\n"):
        return after + "\n"
    if not before.endswith("\n") and after.endswith("\n"):
        return after[:-1]
    return after


def _ambiguous_message(shown: str, e: Ambiguous) -> str:
    lines = ", ".join(str(n) for n in e.lines[:20]) + (" …" if len(e.lines) > 20 else "")
    how = "old_string" if e.tier == "exact" else f"old_string (with {e.tier.replace('_', ' ')} tolerance)"
    fix = ("Include more surrounding lines to make it unique, or set replace_all=true to change every one."
           if e.tier == "exact" else
           "Copy old_string exactly from the file, with enough surrounding lines to make it unique.")
    return f"{how} matches {len(e.lines)} places in {shown} (lines {lines}). {fix} The file is unchanged."


def _no_match_message(shown: str, text: str, old: str) -> str:
    msg = f"old_string was not found in {shown}. The file is unchanged."
    close = closest_region(text, old)
    if close is None or close.similarity < 0.3:
        return msg + " Read the file again and copy the text exactly."
    lines = text.split("\n")
    lo = max(1, close.start_line - 2)
    hi = min(len(lines), close.end_line + 2, lo + MAX_SNIPPET_LINES)
    region = "\n".join(f"{n:>6}\t{lines[n - 1]}" for n in range(lo, hi + 1))
    msg += (f"\nThe most similar region is lines {close.start_line}-{close.end_line} "
            f"({close.similarity:.0%} similar):\n{region}")
    if close.first_diff:
        n, expected, found = close.first_diff
        msg += f"\nFirst difference at line {n}:\n  old_string has: {expected!r}\n  file has:       {found!r}"
    return msg


def _snippet(text: str, first_line: int, replacement: str) -> str:
    lines = text.split("\n")
    span = replacement.count("\n") + 1
    lo = max(1, first_line - SNIPPET_CONTEXT)
    hi = min(len(lines), first_line + span - 1 + SNIPPET_CONTEXT, lo + MAX_SNIPPET_LINES - 1)
    return "\n".join(f"{n:>6}\t{lines[n - 1]}" for n in range(lo, hi + 1))
