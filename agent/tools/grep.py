"""grep: regex search over the workspace with ripgrep, pure-Python fallback when `rg` is missing.

Both backends produce the same structure (per file: matching and context lines), which one formatter
turns into output sorted by path, so results are stable run to run even though rg searches in
parallel. The whole result set is sorted before capping; past MAX_COLLECT lines the search stops early
and says so (a pattern that broad needs narrowing, not more output).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext
from agent.tools.fileio import SNIFF_BYTES, looks_binary
from agent.tools.files import RG_TIMEOUT_S, glob_matcher, list_files, rg_base_args, rg_glob_args, walk

DEFAULT_HEAD_LIMIT = {"files_with_matches": 200, "content": 300, "count": 200}
MAX_COLLECT = 50_000
MAX_LINE_CHARS = 400
MAX_OUTPUT_CHARS = 40_000
_RG_LINE = re.compile(r"(\d+)([:-])")


@dataclass
class FileHits:
    count: int = 0
    # (line number, is_match, text)
    lines: list[tuple[int, bool, str]] = field(default_factory=list)


@tool(parallel_safe=True)
def grep(
    ctx: ToolContext,
    pattern: str,
    path: str | None = None,
    glob: str | None = None,
    output_mode: Literal["files_with_matches", "content", "count"] = "files_with_matches",
    context: Annotated[int, {"minimum": 0, "maximum": 20}] = 0,
    case_insensitive: bool = False,
    head_limit: Annotated[int | None, {"minimum": 1}] = None,
) -> ToolResult:
    """Search file contents with a regular expression (ripgrep syntax), respecting .gitignore.
    Default output lists matching files; `content` shows matching lines as path:line:text; `count`
    shows matches per file. Results are sorted by path and capped.

    Args:
        pattern: Regular expression to search for (ripgrep/Rust syntax; escape literal braces and parens).
        path: File or folder to search, relative to the workspace root. Default: the whole workspace.
        glob: Only search files matching this glob, e.g. "*.py" or "src/**/*.ts" (relative to `path`).
        output_mode: "files_with_matches" (default), "content" (matching lines), or "count".
        context: Lines of context around each match (content mode only).
        case_insensitive: Match case-insensitively.
        head_limit: Show at most this many files (or lines in content mode). Defaults: 200 files, 300 lines.
    """
    if not pattern:
        raise ToolError("pattern is empty")
    target = ctx.workspace.resolve(path or ".")
    if not target.exists():
        raise ToolError(f"{path} does not exist")
    if output_mode != "content":
        context = 0
    limit = head_limit or DEFAULT_HEAD_LIMIT[output_mode]
    if ctx.rg:
        hits, partial = _rg_search(ctx, target, pattern, glob, output_mode, context, case_insensitive)
    else:
        hits, partial = _py_search(ctx, target, pattern, glob, output_mode, context, case_insensitive)
    return _format(hits, partial, output_mode, limit, pattern)


def _rg_search(ctx, target: Path, pattern, glob, mode, context, icase) -> tuple[dict[str, FileHits], bool]:
    argv = rg_base_args(ctx.rg)
    if mode == "files_with_matches":
        argv.append("--files-with-matches")
    elif mode == "count":
        argv += ["--count", "--with-filename"]
    else:
        argv += ["--line-number", "--with-filename", "--no-heading", "--null",
                 "--max-columns", str(MAX_LINE_CHARS), "--max-columns-preview"]
        if context:
            argv += ["--context", str(context)]
    if icase:
        argv.append("--ignore-case")
    argv += ["--regexp", pattern]
    # Run inside the folder searched so globs are relative to it; prefix paths afterwards.
    if target.is_dir():
        cwd, prefix = target, _prefix(ctx, target)
        name_args = rg_glob_args(glob) if glob else None
        if name_args:
            argv += name_args
        elif glob:
            # A glob with a folder part: pick the files first (ignore rules kept), search only those.
            files, _ = list_files(ctx, target, glob=glob)
            if not files:
                return {}, False
            argv += ["--", *(os.path.relpath(ctx.root / f, target) for f in files)]
    else:
        cwd, prefix = ctx.root, ""
        argv += ["--", os.path.relpath(target, ctx.root)]
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    hits: dict[str, FileHits] = {}
    partial = False
    n = 0
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        if not line:
            continue
        n += 1
        if n > MAX_COLLECT:
            partial = True
            proc.kill()
            break
        _parse_rg_line(line, mode, prefix, hits)
    try:
        _, err = proc.communicate(timeout=RG_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise ToolError(f"search took longer than {RG_TIMEOUT_S} s; narrow the path or pattern") from None
    if proc.returncode == 2 and not hits and not partial:
        msg = err.decode(errors="replace").strip()
        if "regex parse error" in msg or "error:" in msg:
            raise ToolError(f"invalid pattern: {msg}")
    return hits, partial


def _prefix(ctx: ToolContext, target: Path) -> str:
    shown = ctx.workspace.display(target)
    return "" if shown == "." else shown + "/"


def _parse_rg_line(line: str, mode: str, prefix: str, hits: dict[str, FileHits]) -> None:
    if mode == "files_with_matches":
        hits.setdefault(prefix + line, FileHits()).count += 1
        return
    if mode == "count":
        path, _, num = line.rpartition(":")
        if num.isdigit():
            hits.setdefault(prefix + path, FileHits()).count = int(num)
        return
    if line == "--" or "\0" not in line:
        return
    path, _, rest = line.partition("\0")
    m = _RG_LINE.match(rest)
    if not m:
        return
    fh = hits.setdefault(prefix + path, FileHits())
    is_match = m.group(2) == ":"
    fh.count += is_match
    fh.lines.append((int(m.group(1)), is_match, rest[m.end():]))


def _py_search(ctx, target: Path, pattern, glob, mode, context, icase) -> tuple[dict[str, FileHits], bool]:
    try:
        rx = re.compile(pattern, re.IGNORECASE if icase else 0)
    except re.error as e:
        raise ToolError(f"invalid pattern: {e}") from None
    if target.is_dir():
        matcher = glob_matcher(glob) if glob else None
        prefix = _prefix(ctx, target)
        files = [(prefix + rel, target / rel) for rel, is_dir in walk(target)
                 if not is_dir and (matcher is None or matcher(rel))]
    else:
        files = [(ctx.workspace.display(target), target)]
    hits: dict[str, FileHits] = {}
    collected = 0
    for shown, real in files:
        try:
            raw = real.read_bytes()
        except OSError:
            continue
        if looks_binary(raw[:SNIFF_BYTES]):
            continue
        lines = raw.decode("utf-8", errors="replace").splitlines()
        matches = [i for i, ln in enumerate(lines) if rx.search(ln)]
        if not matches:
            continue
        fh = hits[shown] = FileHits(count=len(matches))
        if mode == "content":
            wanted = sorted({j for i in matches for j in range(max(0, i - context), min(len(lines), i + context + 1))})
            is_match = set(matches)
            for j in wanted:
                text = lines[j]
                if len(text) > MAX_LINE_CHARS:
                    text = text[:MAX_LINE_CHARS] + " [... omitted end of long line]"
                fh.lines.append((j + 1, j in is_match, text))
            collected += len(wanted)
        else:
            collected += 1
        if collected > MAX_COLLECT:
            return hits, True
    return hits, False


def _format(hits: dict[str, FileHits], partial: bool, mode: str, limit: int, pattern: str) -> ToolResult:
    paths = sorted(hits)
    data = {"mode": mode, "files": len(paths), "matches": sum(h.count for h in hits.values()), "partial": partial}
    if not paths:
        return ToolResult(f"No matches for {pattern!r}.", data=data | {"hits": []})
    out: list[str] = []
    shown_hits: list[dict] = []
    truncated = False
    if mode == "files_with_matches":
        out = paths[:limit]
        truncated = len(paths) > limit
        shown_hits = [{"path": p} for p in out]
        header = f"{len(paths)} file(s) match"
    elif mode == "count":
        out = [f"{p}:{hits[p].count}" for p in paths[:limit]]
        truncated = len(paths) > limit
        shown_hits = [{"path": p, "count": hits[p].count} for p in paths[:limit]]
        header = f"{data['matches']} match(es) in {len(paths)} file(s)"
    else:
        header = f"{data['matches']} matching line(s) in {len(paths)} file(s)"
        for p in paths:
            prev = None
            for num, is_match, text in hits[p].lines:
                if prev is not None and num > prev + 1:
                    out.append("--")
                out.append(f"{p}{':' if is_match else '-'}{num}{':' if is_match else '-'}{text}")
                if is_match:
                    shown_hits.append({"path": p, "line": num, "text": text})
                prev = num
            if len(out) >= limit:
                truncated = len(out) > limit or p != paths[-1]
                out = out[:limit]
                break
    text = "\n".join(out)
    if len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS].rsplit("\n", 1)[0]
        truncated = True
    notes = []
    if truncated:
        notes.append("output capped: narrow the pattern, path or glob, or raise head_limit")
    if partial:
        notes.append(f"search stopped after {MAX_COLLECT} results: the pattern is too broad")
    footer = "".join(f"\n[{n}]" for n in notes)
    return ToolResult(f"{header}:\n{text}{footer}", data=data | {"hits": shown_hits[:limit]})
