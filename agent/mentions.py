"""`@` file mentions: fuzzy completion over the repository's files, and attaching mentioned files.

Candidates are `git ls-files` (tracked and untracked-not-ignored), or the .gitignore-aware walk outside
git. Matching is fuzzy the way fzf-style pickers are: the query's characters must appear in order;
matches in the file name, at word starts and in runs score higher, shorter paths break ties.
A mentioned file's content goes into the turn in read_file's numbered format, so the model sees it
exactly as if it had read it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from agent.tools import ToolContext
from agent.tools.base import ToolError

# What separates the typed text from the attached files (agent.render.typed_text cuts there).
MENTION_APPENDIX = "\n\nFiles the user mentioned:\n"
MENTION = re.compile(r"(?<![\w@])@([\w.\-/~+]+[\w/])")
MAX_ATTACH_LINES = 2000


def repo_files(root: Path, limit: int = 50_000) -> list[str]:
    try:
        proc = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                              text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        proc = None
    if proc is not None and proc.returncode == 0:
        return [f for f in proc.stdout.splitlines() if f and not f.startswith(".composer/")][:limit]
    from agent.tools.files import list_files

    files, _ = list_files(ToolContext.for_root(root), root, limit=limit)
    return sorted(files)


def score(query: str, path: str) -> float | None:
    """A fuzzy score (higher is better) or None when `query` is not a subsequence of `path`."""
    q, p = query.lower(), path.lower()
    if not q:
        return 0.0
    name_start = p.rfind("/") + 1
    pos, total, run, last = 0, 0.0, 0, -2
    for ch in q:
        i = p.find(ch, pos)
        if i < 0:
            return None
        run = run + 1 if i == last + 1 else 1
        bonus = 1.0 + run
        if i >= name_start:
            bonus += 2.0
        if i == 0 or p[i - 1] in "/_-. ":
            bonus += 3.0
        total += bonus
        last, pos = i, i + 1
    if p.endswith(q) or p[name_start:].startswith(q):
        total += 5.0
    return total - 0.05 * len(p)


def complete(query: str, files: list[str], limit: int = 20) -> list[str]:
    scored = [(s, f) for f in files if (s := score(query, f)) is not None]
    scored.sort(key=lambda t: (-t[0], t[1]))
    return [f for _, f in scored[:limit]]


def mentioned_paths(text: str) -> list[str]:
    return list(dict.fromkeys(m.group(1) for m in MENTION.finditer(text)))


def expand(text: str, ctx: ToolContext) -> tuple[str, list[str]]:
    """The turn's text with each mentioned file attached; returns (text, attached paths)."""
    from agent.tools.list_dir import list_dir
    from agent.tools.read_file import read_file

    blocks, attached = [], []
    for raw in mentioned_paths(text):
        try:
            real = ctx.workspace.resolve(raw)
        except ToolError:
            continue
        if not real.exists():
            continue
        shown = ctx.workspace.display(real)
        try:
            if real.is_dir():
                body = list_dir.handler(ctx, path=shown).content
            else:
                body = read_file.handler(ctx, path=shown, limit=MAX_ATTACH_LINES).content
        except ToolError as e:
            body = f"(could not attach: {e})"
        blocks.append(f'<file path="{shown}">\n{body}\n</file>')
        attached.append(shown)
    if not blocks:
        return text, []
    return text + MENTION_APPENDIX + "\n".join(blocks), attached
