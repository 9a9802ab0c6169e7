"""list_dir: a compact, depth-limited tree of a folder (git-ignored files and .git left out)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext
from agent.tools.files import list_files

MAX_DEPTH = 3
MAX_ENTRIES_PER_DIR = 40
MAX_LINES = 400


@dataclass
class _Node:
    dirs: dict[str, _Node] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    total: int = 0


@tool(parallel_safe=True)
def list_dir(ctx: ToolContext, path: str | None = None) -> ToolResult:
    """Show a folder as a compact tree, three levels deep; deeper folders are summarised with their file
    counts. Git-ignored files and .git are left out.

    Args:
        path: Folder to list, relative to the workspace root. Default: the workspace root.
    """
    base = ctx.workspace.resolve(path or ".")
    if not base.exists():
        raise ToolError(f"{path} does not exist")
    if not base.is_dir():
        raise ToolError(f"{path} is a file, not a folder (use read_file to read it)")
    files, truncated = list_files(ctx, base, limit=200_000)
    prefix = ctx.workspace.display(base)
    strip = 0 if prefix == "." else len(prefix) + 1
    tree = _Node()
    for f in files:
        node = tree
        node.total += 1
        *dirs, name = f[strip:].split("/")
        for d in dirs:
            node = node.dirs.setdefault(d, _Node())
            node.total += 1
        node.files.append(name)
    lines: list[str] = []
    _render(tree, 0, lines)
    header = f"{prefix}/ ({tree.total} file(s){', listing capped' if truncated else ''})"
    if not files:
        return ToolResult(f"{prefix}/ has no files (or only git-ignored ones).", data={"files": 0})
    body = lines[:MAX_LINES]
    if len(lines) > MAX_LINES:
        body.append(f"… {len(lines) - MAX_LINES} more lines; list a subfolder to see them")
    return ToolResult(header + "\n" + "\n".join(body), data={"files": tree.total})


def _render(node: _Node, depth: int, out: list[str]) -> None:
    pad = "  " * depth
    entries = [(name, child) for name, child in sorted(node.dirs.items())]
    entries += [(name, None) for name in sorted(node.files)]
    for i, (name, child) in enumerate(entries):
        if i == MAX_ENTRIES_PER_DIR:
            out.append(f"{pad}… {len(entries) - i} more entries")
            break
        if child is None:
            out.append(f"{pad}{name}")
        elif depth + 1 >= MAX_DEPTH:
            out.append(f"{pad}{name}/ ({child.total} file(s))")
        else:
            out.append(f"{pad}{name}/")
            _render(child, depth + 1, out)
