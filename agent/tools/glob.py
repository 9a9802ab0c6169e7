"""glob: find files by name pattern, newest first."""

from __future__ import annotations

import os

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext
from agent.tools.files import list_files

MAX_RESULTS = 100


@tool(parallel_safe=True)
def glob(ctx: ToolContext, pattern: str, path: str | None = None) -> ToolResult:
    """Find files whose path matches a glob pattern, newest first, respecting .gitignore. Patterns follow
    .gitignore rules: "*.py" matches at any depth, "src/**/*.ts" is anchored at `path`, "**" spans folders.

    Args:
        pattern: Glob pattern, e.g. "**/*.py", "*.md" or "src/**/test_*.py".
        path: Folder to search in, relative to the workspace root. Default: the whole workspace.
    """
    if not pattern.strip():
        raise ToolError("pattern is empty")
    base = ctx.workspace.resolve(path or ".")
    if not base.is_dir():
        raise ToolError(f"{path} is not a folder")
    # rg treats a leading "./" as a literal path component; models write it often.
    pattern = pattern.strip().removeprefix("./")
    files, _ = list_files(ctx, base, glob=pattern)
    stamped = []
    for f in files:
        try:
            stamped.append((os.stat(ctx.root / f).st_mtime, f))
        except OSError:
            continue
    stamped.sort(key=lambda t: (-t[0], t[1]))
    shown = [f for _, f in stamped[:MAX_RESULTS]]
    data = {"total": len(stamped), "paths": shown}
    if not shown:
        return ToolResult(f"No files match {pattern!r}.", data=data)
    header = f"{len(stamped)} file(s) match {pattern!r}"
    if len(stamped) > MAX_RESULTS:
        header += f"; the {MAX_RESULTS} newest are shown (narrow the pattern for the rest)"
    return ToolResult(header + ":\n" + "\n".join(shown), data=data)
