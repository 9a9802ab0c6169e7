"""Does a query ask for a type or for a function? A prior from its first word, learned from mined docs.

Doc comments say what they document in their first word: a function's begins with a verb ("Return",
"Parses", "Create"), a type's with a noun phrase ("A", "Base", "Raised when", "Represents"). Queries
written like doc comments do the same, and so do many a person types ("a class that...", "parse the
config"). BM25 and the embedder both rank a class whose name carries the query's words above the
function the query describes ("Get the domain of an address." -> class `Domain` before `get_domain`);
this prior moves them apart by what the first word says.

The table (`query_kinds.json`) counts, over the mined training pairs (third-party code, six languages,
`bench/embedder.py kinds` rebuilds it), how often a doc whose first sentence starts with a word documents
a type and how often a function. For a query whose first word is `w`, with `p` the smoothed share of
types among `w`'s docs and `pi` the share among all, a type definition's fused score moves by
`weight * ln(p / pi)` and a function's by `weight * ln((1 - p) / (1 - pi))`: nothing for a word the
table does not know or that documents both alike, and code outside definitions never moves.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

TABLE = Path(__file__).resolve().parent / "query_kinds.json"
SMOOTHING = 10.0  # pseudo-counts at the overall share: a word seen a few times says little
MIN_COUNT = 3  # words seen fewer times are left out of the table

# Lines before the declaration: decorators and annotations (not Java's `@interface`), attributes, comments,
# a C++ template header on its own line.
_SKIP = re.compile(r"\s*(?:$|@(?!interface\b)|#\[|#!\[|//|/\*|\*|#(?!define)|\"\"\"|'''|template\s*<[^>]*>\s*$)")
_TYPE = re.compile(
    r"\s*(?:template\s*<[^>]*>\s*)?(?:export\s+)?(?:default\s+)?(?:declare\s+)?"
    r"(?:(?:public|private|protected|internal|abstract|final|static|sealed|non-sealed|strictfp|"
    r"pub(?:\([^)]*\))?|unsafe|data|open)\s+)*"
    r"(?:class|interface|@interface|enum|record|struct|union|trait|impl\b|typedef\s+(?:struct|union|enum)|"
    r"type\s+\w+(?:\[[^\]]*\])?\s+(?:struct|interface)|type\s+\w+(?:<[^>]*>)?\s*=)(?![\w(])")
# A C function that returns a struct (`struct point *make_point(int x)`) is not a struct.
_C_FUNCTION = re.compile(r"\s*(?:(?:static|inline|extern|const)\s+)*(?:struct|union|enum)\s+\w+[\s*]+\w+\s*\(")
_WORD = re.compile(r"[a-z][a-z0-9_'-]*")
_HEAD = re.compile(r"[a-z0-9]+(?: [a-z0-9]+)*")  # the name and context lines of a dense text (sync.dense_texts)


def definition_kind(text: str) -> str:
    """"type" when the definition's first line of code declares a class, struct, interface, enum, trait,
    impl block or type; else "function"."""
    for line in text.split("\n", 12)[:12]:
        if _SKIP.match(line):
            continue
        return "type" if _TYPE.match(line) and not _C_FUNCTION.match(line) else "function"
    return "function"


def first_word(query: str) -> str:
    m = _WORD.match(query.strip().lstrip("\"'`([").lower())
    return m.group(0) if m else ""


def labelled(pairs: Iterable) -> Iterator[tuple[str, str]]:
    """(doc's first sentence, kind of the definition it documents) of the mined first-sentence pairs
    (`embed_mine.Pair`); the kind is read from the code after the dense text's name and context lines."""
    for p in pairs:
        if p.kind != "sentence":
            continue
        lines = p.positive.split("\n")
        code = lines[next((i for i, x in enumerate(lines[:2]) if not _HEAD.fullmatch(x)), min(2, len(lines))):]
        yield p.query, definition_kind("\n".join(code))


def build_table(pairs: Iterable) -> dict:
    """The table from mined pairs (first-sentence pairs only): first word -> docs of types, docs of
    functions."""
    counts = {"type": Counter(), "function": Counter()}
    for query, kind in labelled(pairs):
        w = first_word(query)
        if w:
            counts[kind][w] += 1
    total = counts["type"] + counts["function"]
    keep = sorted(w for w, n in total.items() if n >= MIN_COUNT)
    return {"docs": {k: sum(c.values()) for k, c in counts.items()},
            "words": {w: [counts["type"][w], counts["function"][w]] for w in keep}}


@cache
def _table(path: Path = TABLE) -> dict:
    return json.loads(path.read_text())


def biases(query: str, table: dict | None = None) -> dict[str, float]:
    """The log-odds shift of each kind for this query (unscaled): {"type": ..., "function": ...}."""
    t = table or _table()
    types, funcs = t["docs"]["type"], t["docs"]["function"]
    pi = types / max(types + funcs, 1)
    n_type, n_func = t["words"].get(first_word(query), (0, 0))
    p = (n_type + SMOOTHING * pi) / (n_type + n_func + SMOOTHING)
    return {"type": math.log(p / pi), "function": math.log((1 - p) / (1 - pi))}


def apply(query: str, fused: list[tuple[int, float]], rows: dict, weight: float) -> list[tuple[int, float]]:
    """`fused` (chunk id, score) with each definition's score moved by its kind's bias, best first again."""
    if weight == 0 or not fused:
        return fused
    b = biases(query)
    out = []
    for cid, score in fused:
        r = rows.get(cid)
        shift = weight * b[definition_kind(r.text)] if r is not None and r.unit else 0.0
        out.append((cid, score + shift))
    return sorted(out, key=lambda kv: (-kv[1], kv[0]))
