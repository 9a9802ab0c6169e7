"""read_file: numbered lines of a text file, a window at a time."""

from __future__ import annotations

import difflib
import os
from typing import Annotated

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext
from agent.tools.fileio import SNIFF_BYTES, decode, looks_binary

DEFAULT_LIMIT = 2000
MAX_LINE_CHARS = 2000
MAX_OUTPUT_CHARS = 200_000


@tool(parallel_safe=True)
def read_file(
    ctx: ToolContext,
    path: str,
    offset: Annotated[int, {"minimum": 1}] = 1,
    limit: Annotated[int, {"minimum": 1}] = DEFAULT_LIMIT,
) -> ToolResult:
    """Read a text file. Lines come numbered like `cat -n` (number, tab, text); the numbers are not
    part of the file. Reads up to 2000 lines from `offset`; very long lines are cut. Read several files
    in one turn by calling this tool several times at once.

    Args:
        path: File path, relative to the workspace root (or absolute inside it).
        offset: 1-based line number to start reading from.
        limit: Maximum number of lines to read (default 2000).
    """
    real = ctx.workspace.resolve(path)
    shown = ctx.workspace.display(real)
    buffer = ctx.editor.read(real) if ctx.editor is not None and not real.is_dir() else None
    lines = buffer.splitlines() if buffer is not None else _disk_lines(real, shown)
    total = len(lines)
    if total == 0:
        return ToolResult(f"{shown} is empty (0 lines).", data={"path": shown, "total_lines": 0})
    if offset > total:
        raise ToolError(f"offset {offset} is past the end of {shown}, which has {total} lines")
    out: list[str] = []
    size = 0
    end = offset - 1
    for n in range(offset - 1, min(total, offset - 1 + limit)):
        line = lines[n]
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + f" … [line cut: {len(line)} chars]"
        row = f"{n + 1:>6}\t{line}"
        if size + len(row) > MAX_OUTPUT_CHARS and out:
            break
        out.append(row)
        size += len(row) + 1
        end = n + 1
    text = "\n".join(out)
    if end < total:
        text += f"\n[showing lines {offset}-{end} of {total}; continue with offset={end + 1}]"
    return ToolResult(text, data={"path": shown, "start_line": offset, "end_line": end, "total_lines": total})


def _disk_lines(real, shown: str) -> list[str]:
    if real.is_dir():
        raise ToolError(f"{shown} is a directory, not a file (use list_dir to see its contents)")
    if not real.exists():
        raise ToolError(f"{shown} does not exist{_did_you_mean(real)}")
    try:
        raw = real.read_bytes()
    except OSError as e:
        raise ToolError(f"cannot read {shown}: {e.strerror}") from None
    if looks_binary(raw[:SNIFF_BYTES]):
        raise ToolError(f"{shown} is a binary file ({len(raw)} bytes); read_file only shows text files")
    return decode(raw).text.splitlines()


def _did_you_mean(real: os.PathLike) -> str:
    from pathlib import Path

    p = Path(real)
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        names = os.listdir(parent)
    except OSError:
        return ""
    close = difflib.get_close_matches(p.name, names, n=3, cutoff=0.6)
    if not close:
        return ""
    return "; similar names in that folder: " + ", ".join(close)
