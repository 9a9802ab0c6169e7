"""Walking the workspace the way git sees it: .gitignore respected, `.git/` skipped, hidden files kept.

ripgrep (`rg --files`) does the walk when it is available (fast, parallel); otherwise a pure-Python
walker applies the .gitignore files it meets with `pathspec` (gitwildmatch semantics, as rg does).
Our own temp files (`*.composer-tmp`) are never listed. Globs follow gitignore rules in both: a pattern without `/` matches a name at any depth, one with `/`
is anchored at the search folder, `**` spans folders.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from agent.tools.base import ToolError
from agent.tools.context import ToolContext
from agent.tools.fileio import TEMP_SUFFIX

RG_TIMEOUT_S = 60
SKIP_DIRS = {".git"}


def rg_base_args(rg: str) -> list[str]:
    # Temp files of our own writes (beside the target only when .composer/tmp is on another filesystem).
    return [rg, "--hidden", "--no-require-git", "--glob", "!.git", "--glob", f"!*{TEMP_SUFFIX}", "--no-config"]


def list_files(ctx: ToolContext, base: Path, glob: str | None = None,
               limit: int | None = None) -> tuple[list[str], bool]:
    """Non-ignored files under `base` (a folder), as paths relative to the workspace root.

    Returns (paths, truncated). Order is the walk's, not sorted.
    """
    prefix = os.path.relpath(base, ctx.root)
    if ctx.rg:
        rel = _rg_files(ctx.rg, base, glob)
    else:
        rel = _walk_files(base, glob, limit)
    truncated = limit is not None and len(rel) > limit
    if truncated:
        rel = rel[:limit]
    if prefix != ".":
        rel = [f"{prefix}/{r}" for r in rel]
    return rel, truncated


def rg_glob_args(glob: str) -> list[str] | None:
    """rg arguments keeping only files whose name matches `glob`, or None if it has a folder part.

    rg's own --glob is an override that beats .gitignore (`--glob '*.log'` would list ignored logs),
    so name-only globs become a file type, which filters without overriding; globs with a folder part
    are matched in Python instead (`glob_matcher`).
    """
    negated = glob.startswith("!")
    name = glob[1:] if negated else glob
    name = name.removeprefix("**/")
    if "/" in name or not name:
        return None
    return ["--type-add", f"composerglob:{name}", "--type-not" if negated else "--type", "composerglob"]


def glob_matcher(glob: str):
    """A predicate on paths relative to the search folder, with .gitignore glob semantics."""
    negated = glob.startswith("!")
    spec = compile_glob(glob[1:] if negated else glob)
    return (lambda rel: not spec.match_file(rel)) if negated else spec.match_file


def _rg_files(rg: str, base: Path, glob: str | None) -> list[str]:
    argv = rg_base_args(rg) + ["--files"]
    name_args = rg_glob_args(glob) if glob else None
    if name_args:
        argv += name_args
    try:
        proc = subprocess.run(argv, cwd=base, capture_output=True, timeout=RG_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ToolError(f"listing files took longer than {RG_TIMEOUT_S} s; narrow the path") from None
    if proc.returncode not in (0, 1):
        raise ToolError(f"rg failed: {proc.stderr.decode(errors='replace').strip()}")
    files = [p for p in proc.stdout.decode(errors="surrogateescape").splitlines() if p]
    if glob and name_args is None:
        match = glob_matcher(glob)
        files = [f for f in files if match(f)]
    return files


def compile_glob(glob: str):
    import pathspec

    return pathspec.GitIgnoreSpec.from_lines([glob])


def walk(base: Path):
    """Yield (relative posix path, is_dir) for non-ignored entries under `base`, top-down, sorted."""
    import pathspec

    # The .gitignore specs in force for each folder still to visit: (folder relative to base, spec).
    inherited: dict[str, list[tuple[str, object]]] = {"": []}
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = os.path.relpath(dirpath, base)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        active = inherited.pop(rel_dir, [])
        spec = _gitignore_spec(Path(dirpath), pathspec, top=not rel_dir)
        if spec is not None:
            active = active + [(rel_dir, spec)]
        kept = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if d in SKIP_DIRS or os.path.islink(os.path.join(dirpath, d)) or _ignored(active, rel + "/"):
                continue
            kept.append(d)
            inherited[rel] = active
            yield rel, True
        dirnames[:] = kept
        for f in sorted(filenames):
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if not f.endswith(TEMP_SUFFIX) and not _ignored(active, rel):
                yield rel, False


def _walk_files(base: Path, glob: str | None, limit: int | None) -> list[str]:
    matcher = glob_matcher(glob) if glob else None
    out = []
    for rel, is_dir in walk(base):
        if is_dir:
            continue
        if matcher is not None and not matcher(rel):
            continue
        out.append(rel)
        if limit is not None and len(out) > limit:
            break
    return out


def _gitignore_spec(folder: Path, pathspec, top: bool = False):
    """The folder's .gitignore; at the top of the walk also .git/info/exclude (which .gitignore
    overrides, so it comes first: the last matching pattern wins)."""
    lines: list[str] = []
    sources = (folder / ".git" / "info" / "exclude", folder / ".gitignore") if top else (folder / ".gitignore",)
    for path in sources:
        try:
            lines += path.read_text(errors="replace").splitlines()
        except OSError:
            pass
    return pathspec.GitIgnoreSpec.from_lines(lines) if lines else None


def _ignored(active: list[tuple[str, object]], rel: str) -> bool:
    ignored = False
    for folder, spec in active:
        sub = rel[len(folder) + 1 :] if folder else rel
        if folder and not rel.startswith(folder + "/"):
            continue
        result = spec.check_file(sub)  # type: ignore[attr-defined]
        if result.include is not None:
            ignored = bool(result.include)
    return ignored
