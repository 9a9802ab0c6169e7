"""`composer-agent index` and `composer-agent search`: flags, progress and output for the code index.

The agent's entry point dispatches to `main_index` / `main_search`; each parses its own flags and
returns an exit status (0 ok, 1 failure, 2 bad usage). Reports and notices go to stderr so that
`search --json` prints nothing but the JSON array on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SNIPPET_LINES = 8


def _parse(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    try:
        return p.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse already printed
        return int(e.code or 0) if not isinstance(e.code, str) else 2


def _model_help() -> str:
    from index.embed import DEFAULT_MODEL

    return ("sentence-transformers model folder or name; bundled: code-minilm (ours, trained on code) "
            f"and minilm (all-MiniLM-L6-v2); default $COMPOSER_EMBED_MODEL, else {DEFAULT_MODEL}; "
            "changing it rebuilds the index")


def _err(prog: str, msg: str) -> None:
    print(f"{prog}: error: {msg}", file=sys.stderr)


class _Progress:
    """A tqdm bar per stage on a terminal; elsewhere one line when embedding starts (for logs)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.bars: dict[str, object] = {}
        self.announced = False

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.tty:
            if stage == "embed" and total and not self.announced:
                print(f"embedding {total} chunks...", file=self.stream, flush=True)
                self.announced = True
            return
        from tqdm import tqdm

        bar = self.bars.get(stage)
        if bar is None:
            desc = {"scan": "scanning files", "chunk": "chunking files", "embed": "embedding"}.get(stage, stage)
            unit = "chunk" if stage == "embed" else "file"
            bar = self.bars[stage] = tqdm(total=total, desc=desc, unit=unit, file=self.stream,
                                          leave=False, dynamic_ncols=True)
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def _open(root: Path, model: str | None, prog: str):
    from index import quiet
    from index.code_index import CodeIndex

    quiet.use_log_file(root / ".composer" / "logs" / "index.log")  # third-party warnings, not on screen

    try:
        return CodeIndex(root, model=model)
    except NotADirectoryError as e:
        _err(prog, str(e))
    except OSError as e:  # a read-only workspace, a full disk
        _err(prog, f"cannot open the index under {root}: {e}")
    return None


def _sync(ix, prog: str, *, rebuild: bool = False):
    """Sync with progress, waiting (and saying so) while another process writes the index. Raises
    EmbedderError for the caller to report."""
    from index.store import IndexBusy

    progress = _Progress()
    try:
        try:
            return ix.sync(rebuild=rebuild, progress=progress, wait=False)
        except IndexBusy:
            print(f"{prog}: another process is updating the index; waiting for it...", file=sys.stderr)
            return ix.sync(rebuild=rebuild, progress=progress, wait=True)
    finally:
        progress.close()


def main_index(argv: list[str], root: Path) -> int:
    prog = "composer-agent index"
    p = argparse.ArgumentParser(prog=prog, description=(
        "Build or update the semantic code index of the workspace (.composer/index/). Only files "
        "changed since the last run are chunked and embedded again."))
    p.add_argument("--rebuild", action="store_true", help="discard the index and build it from scratch")
    p.add_argument("--model", help=_model_help())
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    args = _parse(p, argv)
    if isinstance(args, int):
        return args
    from index.embed import EmbedderError

    ix = _open(root, args.model, prog)
    if ix is None:
        return 2
    try:
        report = _sync(ix, prog, rebuild=args.rebuild)
    except EmbedderError as e:
        _err(prog, str(e))
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; the index keeps what was committed (every changed file by its words, "
              "the vectors embedded so far), and the next run embeds the rest", file=sys.stderr)
        return 130
    finally:
        ix.close()
    if args.json:
        print(json.dumps({**report.__dict__, "summary": report.summary()}, indent=2))
    else:
        print(report.summary())
        if report.skipped:
            print("skipped: " + ", ".join(f"{n} {why}" for why, n in sorted(report.skipped.items())))
    return 0


def main_search(argv: list[str], root: Path) -> int:
    prog = "composer-agent search"
    p = argparse.ArgumentParser(prog=prog, description=(
        "Search the workspace's code by meaning (dense embeddings fused with BM25). Files changed "
        "since the last index are indexed first."))
    p.add_argument("query", help="what you are looking for, in words or code terms")
    p.add_argument("-k", type=int, default=10, help="number of results (default 10)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON array, best first: path, start_line, end_line, symbol, score, text")
    p.add_argument("--path", help="only results in this file or folder")
    p.add_argument("--no-sync", action="store_true", help="search the index as it is, without updating it")
    p.add_argument("--model", help=_model_help())
    args = _parse(p, argv)
    if isinstance(args, int):
        return args
    if args.k < 1:
        _err(prog, "-k must be at least 1")
        return 2
    if not args.query.strip():
        _err(prog, "the query is empty")
        return 2
    prefix = None
    if args.path:
        prefix = _relative(root, args.path)
        if prefix is None:
            _err(prog, f"--path {args.path} is not inside the workspace {os.path.realpath(root)}")
            return 2
    from index.embed import EmbedderError

    ix = _open(root, args.model, prog)
    if ix is None:
        return 2
    try:
        if not args.no_sync:
            report = _sync(ix, prog)
            if report.changed or report.rebuilt:
                print(report.summary(), file=sys.stderr)
        hits = ix.search(args.query, args.k, path=prefix)
    except EmbedderError as e:
        _err(prog, str(e))
        return 1
    except ValueError as e:
        _err(prog, str(e))
        return 1
    finally:
        ix.close()
    if args.json:
        print(json.dumps([h.to_dict() for h in hits], indent=2, ensure_ascii=False))
        return 0
    if not hits:
        print("no results" if not prefix else f"no results under {prefix}")
    for h in hits:
        where = f"{h.path}:{h.start_line}-{h.end_line}"
        print(f"{where}  {h.symbol or '(top level)'}  score {h.score:.4f}")
        lines = h.text.split("\n")
        for line in lines[:SNIPPET_LINES]:
            print(f"    {line}")
        if len(lines) > SNIPPET_LINES:
            print(f"    ... ({len(lines) - SNIPPET_LINES} more lines)")
        print()
    return 0


def _relative(root: Path, path: str) -> str | None:
    """`path` (absolute, or relative to the root) as a POSIX path relative to the root; None outside."""
    root = Path(os.path.realpath(root))
    p = Path(os.path.expanduser(path))
    real = Path(os.path.realpath(p if p.is_absolute() else root / p))
    try:
        rel = real.relative_to(root).as_posix()
    except ValueError:
        return None
    return "" if rel == "." else rel
