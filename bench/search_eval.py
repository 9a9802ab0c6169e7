"""The multi-language, partially documented search evaluation, and the naive baseline it is held to.

Queries: in each corpus (search_corpora.py, plus a slice of the Python standard library), the
functions and methods with a doc comment directly above them (a docstring in Python) whose first
sentence has at least four words, does not name the function, and occurs once in that corpus. A
*sample* of them (SAMPLE_SHARE, at most SAMPLE_MAX per language, fixed seed) loses its doc: the doc's
lines are blanked in the indexed copy (line numbers unchanged), and its first sentence becomes the
query. Every other doc stays, as in real code where some functions are documented and some not. The
answer is the function's line range; a result is right when it overlaps it.

The naive baseline: one unit per function or method, its whole text without any comment or
docstring, all-MiniLM-L6-v2 over it (no path, no header) and BM25 over its lower-cased words, fused
with reciprocal rank fusion (k=60, equal weights).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench import corpus as corpus_mod
from bench import search_corpora
from index.languages import ATTRIBUTES, WRAPPERS, definition, language_for, parser_for

SAMPLE_SHARE = 0.4
SAMPLE_MAX = 40
SAMPLE_MAX_BY_LANG = {"jdk": 400}  # the standard-library set: enough queries for a figure per half
PYTHON_DIRS = ("email", "json", "http", "logging", "urllib", "xml/dom", "importlib")
PYTHON_MAX_LINES = 6_000
FUNCTION_KINDS = {
    "function_definition",
    "function_declaration",
    "generator_function_declaration",
    "method_definition",
    "function_item",
    "method_declaration",
    "constructor_declaration",
    "function",
}
_TAG = re.compile(r"\{@\w+\s+([^}]*)\}")  # javadoc/jsdoc {@code x} {@link x}
_KERNEL_NAME = re.compile(r"^[\w.:]+(\(\))?\s+-\s+")  # kernel-doc: "name() - what it does"


@dataclass(frozen=True)
class Query:
    lang: str
    query: str
    path: str
    start_line: int  # the function (wrappers, decorators included), 1-based inclusive, doc excluded
    end_line: int
    name: str


@dataclass(frozen=True)
class Unit:
    """A function of the naive baseline."""

    path: str
    start_line: int
    end_line: int
    text: str


def python_corpus() -> Path:
    """A slice of the standard library, copied into the cache like the other corpora."""
    root = search_corpora.CACHE / "search-corpora" / "python"
    if not (root / ".complete").exists():
        src = corpus_mod.stdlib_dir()
        lines = 0
        for p in corpus_mod.stdlib_files(src):
            rel = p.relative_to(src).as_posix()
            if not rel.startswith(PYTHON_DIRS):
                continue
            n = p.read_bytes().count(b"\n")
            if lines + n > PYTHON_MAX_LINES:
                continue
            out = root / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, out)
            lines += n
        (root / ".complete").write_text("ok\n")
    return root


def source_root(lang: str) -> Path:
    return python_corpus() if lang == "python" else search_corpora.corpus_dir(lang)


# -- finding functions and their docs ------------------------------------------------------------------


@dataclass
class _Func:
    name: str
    start: int  # 0-based rows of the definition (wrappers included)
    end: int
    doc_rows: list[int]
    doc: str


def functions(path: str, text: str, tree=None) -> list[_Func]:
    lang = language_for(path)
    parser = parser_for(lang) if lang else None
    if parser is None:
        return []
    lines = text.split("\n")
    tree = tree or parser.parse(text.encode("utf-8", errors="surrogatepass"))
    out = []
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        stack.extend(reversed(node.children))
        d = definition(node, lang)
        if d is None or (node.parent is not None and node.parent.type in WRAPPERS):
            continue
        inner = node
        while inner.type in WRAPPERS:
            inner = next(c for c in inner.named_children if definition(c, lang) is not None)
        kind = (
            "function"
            if inner.type in ("lexical_declaration", "variable_declaration", "expression_statement")
            else inner.type
        )
        if kind not in FUNCTION_KINDS:
            continue
        rows, doc = _lead_doc(node, lines)
        if lang == "python" and not rows:
            rows, doc = _docstring(inner, lines)
        out.append(_Func(d.name, node.start_point.row, node.end_point.row, rows, doc))
    return out


def _last_row(node) -> int:
    r0, (r1, c1) = node.start_point.row, node.end_point
    return r1 - 1 if c1 == 0 and r1 > r0 else r1  # a line comment may end at the next row's start


def _alone(node, lines: list[str]) -> bool:
    (r0, c0), (r1, c1) = node.start_point, node.end_point
    if c1 == 0 and r1 > r0:
        return not lines[r0][:c0].strip()
    return not lines[r0][:c0].strip() and not lines[r1][c1:].strip()


def _lead_doc(node, lines: list[str]) -> tuple[list[int], str]:
    rows: list[int] = []
    top = node.start_point.row
    sib = node.prev_named_sibling
    while sib is not None:
        if sib.type in ATTRIBUTES:
            top = sib.start_point.row
        elif (
            "comment" in sib.type
            and _last_row(sib) >= top - 1
            and _alone(sib, lines)
            and not sib.text.startswith((b"//!", b"/*!"))
        ):
            top = sib.start_point.row
            rows = list(range(sib.start_point.row, _last_row(sib) + 1)) + rows
        else:
            break
        sib = sib.prev_named_sibling
    return rows, _clean([lines[r] for r in rows])


def _docstring(inner, lines: list[str]) -> tuple[list[int], str]:
    body = inner.child_by_field_name("body")
    first = body.named_children[0] if body is not None and body.named_children else None
    if (
        first is None
        or first.type != "expression_statement"
        or not first.named_children
        or first.named_children[0].type != "string"
        or not _alone(first, lines)
        or first.start_point.row == inner.start_point.row
    ):
        return [], ""
    rows = list(range(first.start_point.row, _last_row(first) + 1))
    return rows, _clean([lines[r] for r in rows])


def _clean(doc_lines: list[str]) -> str:
    out = []
    for line in doc_lines:
        s = re.sub(r'^\s*(/\*+!?|\*+/|\*+|///?!?|[rRbBuU]?("""|\'\'\'))?\s?', "", line)
        s = re.sub(r'\s*(\*+/|"""|\'\'\')\s*$', "", s).strip()
        if s.startswith("@") or s.startswith(":param") or s.startswith(":return"):
            break  # tags: the description is over
        out.append(s)
    return " ".join(" ".join(out).split())


def plain(doc: str) -> str:
    """A doc's text without javadoc/jsdoc tags, HTML or a kernel-doc `name() - ` lead."""
    doc = _TAG.sub(r"\1", doc)
    doc = re.sub(r"<[^>]+>", "", doc)  # html in javadoc
    return _KERNEL_NAME.sub("", doc)


def first_sentence(doc: str) -> str:
    doc = plain(doc)
    m = re.match(r"(.+?[.!?])(\s|$)", doc)
    return (m.group(1) if m else doc).strip()


# -- building the evaluation ---------------------------------------------------------------------------


def build(lang: str, work: Path) -> tuple[Path, list[Query], list[Unit]]:
    """The corpus copy with the sampled docs blanked, its queries, and the naive baseline's units.
    `LANG-doc` (e.g. `jdk-doc`): LANG's corpus and answers, each query the doc's whole description
    (markup removed, tags cut) instead of its first sentence."""
    if lang.endswith("-doc"):
        return _whole_doc_queries(lang, work)
    src = source_root(lang)
    dst = work / "corpus"
    qfile = work / "queries.jsonl"
    ufile = work / "units.jsonl"
    if qfile.exists() and ufile.exists() and dst.is_dir():
        return (
            dst,
            [Query(**json.loads(x)) for x in qfile.read_text().splitlines()],
            [Unit(**json.loads(x)) for x in ufile.read_text().splitlines()],
        )
    shutil.rmtree(dst, ignore_errors=True)
    texts: dict[str, str] = {}
    funcs: dict[str, list[_Func]] = {}
    for p in search_corpora.source_files(src):
        rel = p.relative_to(src).as_posix()
        try:
            texts[rel] = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        funcs[rel] = functions(rel, texts[rel])
    candidates = []
    for rel, fs in funcs.items():
        for f in fs:
            q = first_sentence(f.doc)
            if (
                len(q.split()) < 4
                or not q[:1].isalpha()
                or len(q) > 300
                or sum(c.isalpha() or c.isspace() for c in q) < 0.85 * len(q)
            ):
                continue  # too short, or code rather than prose
            if len(f.name) >= 4 and re.search(rf"\b{re.escape(f.name)}\b", q):
                continue  # the answer would be in the question
            candidates.append((q, rel, f))
    counts = Counter(q.lower() for q, _, _ in candidates)
    unique = [c for c in candidates if counts[c[0].lower()] == 1]
    rng = random.Random(zlib.crc32(lang.encode()))
    n = min(SAMPLE_MAX_BY_LANG.get(lang, SAMPLE_MAX), max(1, round(SAMPLE_SHARE * len(unique))))
    chosen = rng.sample(unique, min(n, len(unique)))
    blank: dict[str, set[int]] = {}
    queries = []
    for q, rel, f in chosen:
        blank.setdefault(rel, set()).update(f.doc_rows)
        first = min(r for r in range(f.start, f.end + 1) if r not in f.doc_rows)
        queries.append(Query(lang, q, rel, first + 1, f.end + 1, f.name))
    units = []
    for rel, text in texts.items():
        lines = text.split("\n")
        for r in blank.get(rel, ()):
            lines[r] = ""
        new = "\n".join(lines)
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(new, encoding="utf-8")
        lang = language_for(rel)
        tree = parser_for(lang).parse(new.encode("utf-8", errors="surrogatepass"))
        for f in functions(rel, new, tree):
            units.append(Unit(rel, f.start + 1, f.end + 1, _without_comments(rel, new, f, tree)))
    work.mkdir(parents=True, exist_ok=True)
    qfile.write_text("".join(json.dumps(asdict(q)) + "\n" for q in queries))
    ufile.write_text("".join(json.dumps(asdict(u)) + "\n" for u in units))
    return dst, queries, units


def _whole_doc_queries(lang: str, work: Path) -> tuple[Path, list[Query], list[Unit]]:
    base = lang.removesuffix("-doc")
    root, queries, units = build(base, work.with_name(base))
    src = source_root(base)
    out = []
    for q in queries:
        f = next(f for f in functions(q.path, (src / q.path).read_text(encoding="utf-8"))
                 if f.name == q.name and f.end + 1 == q.end_line)
        out.append(Query(lang, plain(f.doc).strip(), q.path, q.start_line, q.end_line, q.name))
    return root, out, units


def _without_comments(rel: str, text: str, f: _Func, tree) -> str:
    """The function's own text with every comment (and Python docstring) removed."""
    lang = language_for(rel)
    data = text.encode("utf-8", errors="surrogatepass")
    lines = data.split(b"\n")
    b_start = sum(len(x) + 1 for x in lines[: f.start])
    b_end = sum(len(x) + 1 for x in lines[: f.end + 1])
    cut: list[tuple[int, int]] = []
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        if node.end_byte <= b_start or node.start_byte >= b_end:
            continue
        if "comment" in node.type or (
            lang == "python"
            and node.type == "expression_statement"
            and node.named_children
            and node.named_children[0].type == "string"
            and node.named_child_count == 1
        ):
            cut.append((node.start_byte, node.end_byte))
            continue
        stack.extend(node.children)
    out, pos = [], b_start
    for s, e in sorted(cut):
        s, e = max(s, b_start), min(e, b_end)
        if s >= pos:
            out.append(data[pos:s])
            pos = e
    out.append(data[pos:b_end])
    body = b"".join(out).decode("utf-8", errors="replace")
    return "\n".join(line for line in body.split("\n") if line.strip())


# -- the naive baseline --------------------------------------------------------------------------------

_WORDS = re.compile(r"\w+")


class NaiveBM25:
    """Okapi BM25 (k1=1.5, b=0.75) over lower-cased words, no stemming, no identifier splitting."""

    def __init__(self, docs: list[str], k1: float = 1.5, b: float = 0.75):
        import scipy.sparse as sp

        vocab: dict[str, int] = {}
        rows, cols, vals = [], [], []
        for i, d in enumerate(docs):
            for t, n in Counter(w.lower() for w in _WORDS.findall(d)).items():
                rows.append(i)
                cols.append(vocab.setdefault(t, len(vocab)))
                vals.append(n)
        tf = sp.csr_matrix((np.asarray(vals, np.float32), (rows, cols)), shape=(len(docs), len(vocab)))
        dl = np.asarray(tf.sum(axis=1)).ravel()
        df = np.bincount(tf.indices, minlength=len(vocab))
        self.idf = np.log1p((len(docs) - df + 0.5) / (df + 0.5)).astype(np.float32)
        row_of = np.repeat(np.arange(len(docs)), np.diff(tf.indptr))
        tf.data = tf.data * (k1 + 1) / (tf.data + k1 * (1 - b + b * dl[row_of] / max(dl.mean(), 1e-9)))
        self.w = tf.tocsc()
        self.vocab = vocab

    def search(self, query: str, n: int) -> list[int]:
        cols = [self.vocab[w] for w in {w.lower() for w in _WORDS.findall(query)} if w in self.vocab]
        if not cols:
            return []
        scores = np.asarray(self.w[:, cols] @ self.idf[cols]).ravel()
        top = np.argsort(-scores, kind="stable")[:n]
        return [int(i) for i in top if scores[i] > 0]


def naive_rankings(
    units: list[Unit], queries: list[Query], emb, n: int = 100
) -> tuple[list[list[int]], list[list[int]]]:
    """(dense ranking, BM25 ranking) of unit indices per query."""
    bm25 = NaiveBM25([u.text for u in units])
    return naive_dense(units, queries, emb, n), [bm25.search(q.query, n) for q in queries]


def naive_dense(units: list[Unit], queries, emb, n: int = 100) -> list[list[int]]:
    """The naive baseline's dense ranking: unit indices per query, by cosine."""
    sims = emb.encode([q.query for q in queries]) @ emb.encode([u.text for u in units]).T
    return [list(np.argsort(-s, kind="stable")[:n]) for s in sims]


def is_dev(path: str) -> bool:
    """Whether a query about `path` is in the development half (else the test half): halves by file,
    so the two share no code."""
    return zlib.crc32(path.encode()) % 2 == 0


def split(queries) -> tuple[list[int], list[int]]:
    """Indices of the development and test halves of queries that have a `.path`."""
    dev = [i for i, q in enumerate(queries) if is_dev(q.path)]
    return dev, [i for i, q in enumerate(queries) if not is_dev(q.path)]
