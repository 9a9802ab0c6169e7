"""Cutting files into chunks that fit the embedder: syntax-aware for code, line windows for the rest.

Approach (after cAST, "split then merge"): walk the tree-sitter syntax tree; a definition (function,
method, class, ...) that fits the token budget becomes one chunk; one that does not is opened up and
its children are packed greedily, in order, into chunks that fit, recursively, so a large class yields
one chunk per method and a large function yields consecutive slices of its body. Statements between
definitions (imports, constants) are packed the same way. Comments directly above a definition travel
with it. Then spans too small to stand alone (a class header line, a closing brace, a one-line
helper) merge into a neighbour while the result still fits.

Sizes are measured in the embedder's own tokens, counted per line (WordPiece/BPE pre-tokenizers split
at whitespace, so line counts add up to the file's count); callers pass the counter, and
`approx_tokens` stands in where no tokenizer is loaded. Chunks are whole lines, never overlap, and
carry the innermost enclosing definition's dotted name as their symbol.

Limits: a single line longer than the budget stays one chunk (the embedder truncates it); names come
from the grammar's `name` fields, so anonymous constructs get their enclosing symbol.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from index.languages import definition, language_for, parser_for

TokenCounter = Callable[[Sequence[str]], list[int]]

DEFAULT_BUDGET = 220
# A span under this many tokens is merged into a neighbour when one has room.
MIN_CHUNK_TOKENS = 24

_WORD = re.compile(r"[A-Za-z]+|\d+|[^\sA-Za-z\d]")


def approx_tokens(lines: Sequence[str]) -> list[int]:
    """A tokenizer-free estimate of WordPiece counts: punctuation marks count one each, words one per
    ~5 letters (long identifiers split into several word pieces)."""
    return [sum(1 + (len(w) - 1) // 5 for w in _WORD.findall(line)) for line in lines]


@dataclass(frozen=True)
class Chunk:
    """A run of whole lines of one file. Lines are 1-based and inclusive."""

    start_line: int
    end_line: int
    symbol: str
    text: str
    tokens: int


@dataclass
class _Piece:
    start: int  # 0-based rows, inclusive
    end: int
    kind: str  # "def", "code" or "comment"
    symbol: str = ""
    parts: list[_Piece] | None = None  # a definition too big for one chunk, opened up


@dataclass
class _Span:
    start: int
    end: int
    symbol: str
    tokens: int = 0
    defs: list[str] = field(default_factory=list)


class _Counter:
    """Token counts of row ranges in O(1) from prefix sums."""

    def __init__(self, per_line: list[int]):
        self.prefix = [0, *accumulate(per_line)]

    def __call__(self, start: int, end: int) -> int:
        return self.prefix[end + 1] - self.prefix[start]


def chunk_file(path: str, text: str, *, budget: int = DEFAULT_BUDGET,
               count_tokens: TokenCounter = approx_tokens,
               min_tokens: int = MIN_CHUNK_TOKENS) -> list[Chunk]:
    """Chunks of one file's text; `path` (POSIX, relative) picks the language by extension."""
    lines = text.split("\n")  # tree-sitter rows break at "\n" only, unlike str.splitlines
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        return []
    counts = count_tokens(lines)
    tok = _Counter(counts)
    spans = None
    lang = language_for(path)
    parser = parser_for(lang) if lang else None
    if parser is not None:
        tree = parser.parse(text.encode("utf-8", errors="surrogatepass"))
        spans = _syntax_spans(tree.root_node, lang, tok, budget, len(lines))
    if spans is None:
        spans = _line_windows(lines, 0, len(lines) - 1, tok, budget, "")
    spans = _merge_small(spans, tok, budget, min_tokens)
    out = []
    for s in spans:
        body = "\n".join(lines[s.start:s.end + 1])
        if body.strip():
            out.append(Chunk(s.start + 1, s.end + 1, s.symbol, body, tok(s.start, s.end)))
    return out


# -- syntax-aware ------------------------------------------------------------------------------------

def _rows(node) -> tuple[int, int]:
    start, end = node.start_point.row, node.end_point.row
    if node.end_point.column == 0 and end > start:  # ends at the very start of the next line
        end -= 1
    return start, end


def _syntax_spans(root, lang: str, tok: _Counter, budget: int, n_lines: int) -> list[_Span] | None:
    pieces: list[_Piece] = []
    _collect_all(root.children, lang, "", tok, budget, pieces, 0, n_lines - 1)
    if not pieces:
        return None
    spans = _pack(pieces, "", tok, budget)
    return _no_overlap(spans, tok, n_lines)


def _collect(node, lang: str, scope: str, tok: _Counter, budget: int, out: list[_Piece]) -> None:
    start, end = _rows(node)
    d = definition(node, lang)
    if d is not None:
        qual = f"{scope}.{d.name}" if scope else d.name
        if tok(start, end) <= budget:
            out.append(_Piece(start, end, "def", qual))
        else:
            parts: list[_Piece] = []
            _collect_all(_opened(node, lang), lang, qual, tok, budget, parts, start, end)
            out.append(_Piece(start, end, "def", qual, parts))
    elif tok(start, end) <= budget or node.child_count == 0:
        out.append(_Piece(start, end, "comment" if "comment" in node.type else "code"))
    else:
        _collect_all(node.children, lang, scope, tok, budget, out, start, end)


def _collect_all(children, lang: str, scope: str, tok: _Counter, budget: int, out: list[_Piece],
                 start: int, end: int) -> None:
    """Pieces of a node's children, plus pieces for lines no child covers (children need not tile
    their parent: the text of a string between its escape sequences belongs to no child)."""
    covered = start - 1
    for child in children:
        cs, ce = _rows(child)
        _gap(covered + 1, cs - 1, tok, out)
        _collect(child, lang, scope, tok, budget, out)
        covered = max(covered, ce)
    _gap(covered + 1, end, tok, out)


def _gap(start: int, end: int, tok: _Counter, out: list[_Piece]) -> None:
    while start <= end and tok(start, start) == 0:  # blank lines need no chunk
        start += 1
    while end >= start and tok(end, end) == 0:
        end -= 1
    if start <= end:
        out.append(_Piece(start, end, "code"))


def _opened(node, lang: str) -> list:
    """The children of a definition being split; a wrapper (decorators, export, template) is opened
    through to the definition inside, so the name is not counted twice."""
    out = []
    for child in node.children:
        if definition(child, lang) is not None and definition(node, lang) is not None and \
                node.type in ("decorated_definition", "export_statement", "template_declaration"):
            out.extend(_opened(child, lang))
        else:
            out.append(child)
    return out


def _pack(pieces: list[_Piece], scope: str, tok: _Counter, budget: int) -> list[_Span]:
    out: list[_Span] = []
    cur: list[_Piece] = []

    def flush() -> None:
        if cur:
            out.append(_group_span(cur, scope, tok))
            cur.clear()

    for p in pieces:
        if p.kind == "def":
            # Comments right above a definition (doc comments in most languages) belong to it.
            lead: list[_Piece] = []
            while cur and cur[-1].kind == "comment" and cur[-1].end >= (lead[0].start if lead else p.start) - 1:
                lead.insert(0, cur.pop())
            flush()
            if p.parts is None and lead and tok(lead[0].start, p.end) > budget:
                out.append(_group_span(lead, scope, tok))  # too big to join: on its own, not with code
                lead = []
            if p.parts is not None:
                out.extend(_pack(lead + p.parts, p.symbol, tok, budget))
            else:
                out.append(_Span(lead[0].start if lead else p.start, p.end, p.symbol, defs=[p.symbol]))
            continue
        if tok(p.start, p.end) > budget and p.end > p.start:
            # One huge leaf (a long string, a table): line windows, the first one starting with what
            # was pending (a class header stays with the start of its long docstring).
            start = cur[0].start if cur else p.start
            cur.clear()
            out.extend(_line_windows(None, start, p.end, tok, budget, scope))
            continue
        if cur and tok(min(cur[0].start, p.start), max(cur[-1].end, p.end)) > budget:
            flush()
        cur.append(p)
    flush()
    return out


def _group_span(group: list[_Piece], scope: str, tok: _Counter) -> _Span:
    defs = [p.symbol for p in group if p.kind == "def"]
    return _Span(min(p.start for p in group), max(p.end for p in group), _symbol_for(defs, scope),
                 defs=defs)


def _no_overlap(spans: list[_Span], tok: _Counter, n_lines: int) -> list[_Span]:
    """Several nodes can share a line (`} else {`); each line goes to the first span that has it."""
    out: list[_Span] = []
    last = -1
    for s in sorted(spans, key=lambda s: (s.start, s.end)):
        start = max(s.start, last + 1)
        end = min(s.end, n_lines - 1)
        if start > end:
            continue
        out.append(_Span(start, end, s.symbol, tok(start, end), s.defs))
        last = end
    return out


def _merge_small(spans: list[_Span], tok: _Counter, budget: int, min_tokens: int) -> list[_Span]:
    """Fold spans under `min_tokens` into the next span (a class header joins its first method) or else
    the previous one (a closing brace joins the last method), when the result fits."""
    out = list(spans)
    i = 0
    while i < len(out):
        s = out[i]
        s.tokens = tok(s.start, s.end)
        if s.tokens >= min_tokens or len(out) == 1:
            i += 1
            continue
        nxt = out[i + 1] if i + 1 < len(out) and tok(s.start, out[i + 1].end) <= budget else None
        prev = out[i - 1] if i > 0 and tok(out[i - 1].start, s.end) <= budget else None
        # Prefer the neighbour in the same class/function: a tiny method stays with its siblings.
        if nxt is not None and (prev is None or _kinship(s, nxt) >= _kinship(s, prev)):
            out[i + 1] = _joined(s, nxt, keep=nxt, tok=tok)
            del out[i]
        elif prev is not None:
            out[i - 1] = _joined(prev, s, keep=prev, tok=tok)
            del out[i]
            i -= 1  # the grown span may itself still be small
        else:
            i += 1
    return out


def _kinship(a: _Span, b: _Span) -> int:
    """How many leading dotted names the scopes of two spans share."""
    n = 0
    for x, y in zip(_scope_of(a).split("."), _scope_of(b).split("."), strict=False):
        if x != y or not x:
            break
        n += 1
    return n


def _scope_of(s: _Span) -> str:
    if s.symbol in s.defs and len(s.defs) == 1:  # a definition: its scope is where it lives
        return s.symbol.rpartition(".")[0]
    return s.symbol


def _joined(a: _Span, b: _Span, *, keep: _Span, tok: _Counter) -> _Span:
    return _Span(a.start, b.end, _symbol_for(a.defs + b.defs, keep.symbol), tok(a.start, b.end),
                 a.defs + b.defs)


def _symbol_for(defs: list[str], scope: str) -> str:
    """A chunk holding one definition is named after it; several, after their common enclosing scope."""
    if len(defs) == 1:
        return defs[0]
    if not defs:
        return scope
    parts = [d.split(".") for d in defs]
    common = []
    for names in zip(*parts, strict=False):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


# -- plain text ----------------------------------------------------------------------------------------

def _line_windows(lines: list[str] | None, start: int, end: int, tok: _Counter, budget: int,
                  symbol: str) -> list[_Span]:
    """Consecutive lines up to the budget, preferring to break at a blank line once half full."""
    out: list[_Span] = []
    s = start
    while s <= end:
        # The furthest end row that still fits (at least one line).
        e = max(s, min(end, bisect_right(tok.prefix, tok.prefix[s] + budget) - 2))
        if lines is not None and e < end:
            for r in range(e, s, -1):
                if not lines[r].strip() and tok(s, r) >= budget // 2:
                    e = r
                    break
        out.append(_Span(s, e, symbol))
        s = e + 1
    return out
