"""write_file: create or overwrite a whole file, atomically."""

from __future__ import annotations

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext
from agent.tools.fileio import SNIFF_BYTES, TextFile, decode, looks_binary, save, unified_diff
from agent.tools.lint import introduced_problems_note


@tool(parallel_safe=False, mutates=True)
def write_file(ctx: ToolContext, path: str, content: str) -> ToolResult:
    """Create a file, or overwrite one, with `content`; parent folders are created. Prefer edit_file for
    changing part of an existing file. Overwriting keeps the file's line endings (CRLF stays CRLF),
    BOM and mode.

    Args:
        path: File to write, relative to the workspace root.
        content: The complete new content of the file.
    """
    real = ctx.workspace.resolve(path, for_write=True)
    shown = ctx.workspace.display(real)
    if real.is_dir():
        raise ToolError(f"{shown} is a directory")
    before: str | None = None
    tf = TextFile(text="")
    buffer = ctx.editor.read(real) if ctx.editor is not None else None
    if buffer is not None:  # the editor's unsaved text is what is overwritten
        before = tf.text = buffer
    elif real.exists():
        raw = real.read_bytes()
        if not looks_binary(raw[:SNIFF_BYTES]):
            tf = decode(raw)
            before = tf.text
        tf.mode = real.stat().st_mode & 0o7777
        if before is not None and tf.newline == "\r\n" and "\r" not in content:
            content = content.replace("\n", "\r\n")
        if tf.encoding == "latin-1":
            try:
                content.encode("latin-1")
            except UnicodeEncodeError:
                tf.encoding = "utf-8"
    save(real, tf, content, ctx.workspace.temp_dir(), ctx.editor)
    lines = content.count("\n") + (0 if content.endswith("\n") or not content else 1)
    verb = "Created" if before is None and tf.mode is None else "Overwrote"
    lint_note, problems = introduced_problems_note(before, content, shown)
    return ToolResult(f"{verb} {shown} ({lines} lines).{lint_note}", data={
        "path": shown, "created": verb == "Created", "diff": unified_diff(before or "", content, shown),
        "lint_errors": problems,
    })
