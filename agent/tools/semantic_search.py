"""semantic_search: meaning-based code search over the workspace's embedding index (see index/).

The index lives in `.composer/index/`; each call first syncs it (cheap when little changed: unchanged
files are recognised by size and mtime without being read), building it on first use. The loaded
index and model are kept in `ctx.search_index` across calls. `index` is imported here, lazily: the
agent must start without torch.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from typing import Annotated

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext

# A first search in a large repository must not stall the agent for many minutes: every file is
# indexed by its words at once, embedding fills about this many seconds of each call (batches sized to
# the time left), and the rest continues on later calls (the answer says so).
SYNC_BUDGET_S = 45.0
SNIPPET_LINES = 12
# What the index needs beyond the agent's own dependencies (found without importing them).
INDEX_MODULES = ("numpy", "scipy", "faiss", "sentence_transformers", "tokenizers", "tree_sitter", "Stemmer")
SHORT_SNIPPET_LINES = 4  # when many results are asked for, keep the answer compact
_open_lock = threading.Lock()


@tool(parallel_safe=True)
def semantic_search(
    ctx: ToolContext,
    query: str,
    k: Annotated[int, {"minimum": 1, "maximum": 50}] = 10,
    path: str | None = None,
) -> ToolResult:
    """Find code by meaning rather than exact text: describe what you are looking for in plain words
    ("where are HTTP retries handled", "function that parses the config file"). Returns ranked code
    chunks (functions, methods, file sections; one per definition) with path:start-end lines, the
    enclosing symbol and a snippet. The index updates itself before each search. Use grep instead for exact identifiers or
    strings.

    Args:
        query: What you are looking for, in natural language or code terms.
        k: Number of results to return (default 10).
        path: Only return results under this folder (or in this file), relative to the workspace root.
    """
    query = query.strip()
    if not query:
        raise ToolError("query is empty; describe the code you are looking for")
    prefix = _prefix(ctx, path)
    missing = _missing_modules(INDEX_MODULES)
    if missing:
        raise ToolError(f"semantic search is not installed here ({', '.join(missing)} missing; it needs the "
                        "`index` extra: pip install 'composer[index]'); use grep and glob to find code")
    from index.embed import EmbedderError
    from index.store import IndexBusy

    ix = _index(ctx)
    notes = []
    try:
        report = ix.sync(wait=False, budget_s=SYNC_BUDGET_S)
        if report.rebuilt or report.changed or report.embedded or report.pending:
            notes.append(report.summary())
    except IndexBusy:
        notes.append("another process is updating the index; results may miss the newest changes")
    except EmbedderError as e:
        raise ToolError(f"{e}; use grep and glob to find code") from None
    try:
        hits = ix.search(query, k, path=prefix)
    except ValueError as e:  # e.g. the index another process is rebuilding is for another model
        raise ToolError(f"{e}; use grep and glob to find code meanwhile") from None
    data = {"hits": [{"path": h.path, "start_line": h.start_line, "end_line": h.end_line,
                      "symbol": h.symbol, "score": h.score} for h in hits],
            "notes": notes}
    if not hits:
        where = f" under {prefix}" if prefix else ""
        empty = "nothing is indexed in this workspace yet" if not ix.chunk_count() else f"no results{where}"
        return ToolResult("\n".join([*notes, f"{empty} for {query!r}; try other words, or grep"]),
                          data=data)
    per_hit = SNIPPET_LINES if k <= 10 else SHORT_SNIPPET_LINES
    out = [*notes] + [""] * bool(notes)
    for i, h in enumerate(hits, start=1):
        out.append(f"{i}. {h.path}:{h.start_line}-{h.end_line}  {h.symbol or '(top level)'}  "
                   f"(score {h.score:.4f})")
        lines = h.text.split("\n")
        for n, line in enumerate(lines[:per_hit], start=h.start_line):
            out.append(f"{n:>6}\t{line[:200]}")
        if len(lines) > per_hit:
            out.append(f"      \t... {len(lines) - per_hit} more lines (read_file {h.path} "
                       f"offset={h.start_line + per_hit})")
        out.append("")
    return ToolResult("\n".join(out).rstrip() + "\n", data=data)


@functools.cache
def _missing_modules(modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` this environment lacks (looked up once: installs do not change mid-run)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _prefix(ctx: ToolContext, path: str | None) -> str | None:
    if path is None or not path.strip() or path.strip() in (".", "./"):
        return None
    real = ctx.workspace.resolve(path)
    if not real.exists():
        raise ToolError(f"{path} does not exist")
    try:
        rel = real.relative_to(ctx.root).as_posix()
    except ValueError:
        raise ToolError(f"{path} is outside the indexed workspace {ctx.root}") from None
    return None if rel == "." else rel


def _index(ctx: ToolContext):
    """The workspace's CodeIndex, opened once per context (parallel calls share it)."""
    from index.code_index import CodeIndex

    with _open_lock:
        ix = ctx.search_index
        if not isinstance(ix, CodeIndex) or ix.root != ctx.root:
            try:
                ix = ctx.search_index = CodeIndex(ctx.root, index_dir=ctx.workspace.state_dir("index"))
            except OSError as e:
                raise ToolError(f"cannot open the search index in .composer/index: {e}; "
                                "use grep and glob to find code") from None
        return ix
