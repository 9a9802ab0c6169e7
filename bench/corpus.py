"""The docstring -> function evaluation set, made from the Python standard library.

The corpus is the stdlib's own modules (`Lib/` without its test suites and without site-packages),
copied with every docstring (module, class, function) blanked out line for line, so line numbers are
unchanged and the answer cannot be found by matching the docstring itself. Each query is the first
sentence of a function's docstring; its answer is that function's line range in its file.

Queries are dropped when they cannot be judged fairly: docstrings sharing a line with code (they
cannot be blanked by lines), first sentences under four words, and sentences that occur more than
once in the corpus (several right answers).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import sysconfig
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Query:
    query: str
    path: str
    start_line: int  # the function, decorators included; 1-based, inclusive
    end_line: int
    name: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(src: Path) -> list[Path]:
    out = []
    for p in sorted(src.rglob("*.py")):
        rel = p.relative_to(src)
        if SKIP_PARTS.intersection(rel.parts[:-1]) or p.is_symlink():
            continue
        out.append(p)
    return out


def first_sentence(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    para = " ".join(para.split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    return (m.group(1) if m else para).strip()


def _docstring_node(node) -> ast.Constant | None:
    body = getattr(node, "body", None)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].value
    return None


def strip_file(text: str) -> tuple[str, list[tuple[ast.AST, str]]] | None:
    """(text with docstrings blanked, [(function node, its docstring)] for the blankable ones)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    lines = text.split("\n")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = _docstring_node(node)
        if doc is None:
            continue
        first, last = doc.lineno - 1, doc.end_lineno - 1
        # Only docstrings that own their lines can be blanked without touching code.
        if lines[first][:doc.col_offset].strip() or lines[last][doc.end_col_offset:].strip():
            continue
        indent = lines[first][:doc.col_offset]
        alone = len(node.body) == 1 and not isinstance(node, ast.Module)
        for i in range(first, last + 1):
            lines[i] = ""
        if alone:  # keep the body valid Python
            lines[first] = indent + "pass"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((node, doc.value))
    return "\n".join(lines), found


def build(work: Path, src: Path | None = None) -> tuple[Path, list[Query]]:
    """Write the stripped corpus under `work/corpus` and the queries to `work/queries.jsonl`."""
    src = src or stdlib_dir()
    corpus = work / "corpus"
    qfile = work / "queries.jsonl"
    if qfile.exists() and corpus.is_dir():
        return corpus, [Query(**json.loads(line)) for line in qfile.read_text().splitlines()]
    if corpus.exists():
        shutil.rmtree(corpus)
    candidates: list[Query] = []
    for p in stdlib_files(src):
        rel = p.relative_to(src).as_posix()
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        stripped = strip_file(text)
        if stripped is None:
            continue
        new_text, funcs = stripped
        out = corpus / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(new_text, encoding="utf-8")
        for node, doc in funcs:
            sentence = first_sentence(doc)
            if len(sentence.split()) < 4 or not sentence[:1].isalpha():
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            candidates.append(Query(sentence, rel, start, node.end_lineno, node.name))
    counts = Counter(q.query.lower() for q in candidates)
    queries = [q for q in candidates if counts[q.query.lower()] == 1]
    work.mkdir(parents=True, exist_ok=True)
    qfile.write_text("".join(json.dumps(asdict(q)) + "\n" for q in queries))
    return corpus, queries
