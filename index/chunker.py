"""Cutting files into chunks that fit the embedder: syntax-aware for code, line windows for the rest.

Approach (after cAST, "split then merge"): walk the tree-sitter syntax tree; a definition (function,
method, ...) that fits the token budget becomes one chunk; one that does not is opened up and its
children are packed greedily, in order, into chunks that fit, recursively, so a large function yields
consecutive slices of its body. Containers (classes, impls, modules) are always opened when they hold
definitions: each member gets a vector of its own. Statements between definitions (imports,
constants) are packed the same way.

Doc prose is kept apart from code. The comment block directly above a definition (and a Python
docstring, the module's too) is its doc: it stays in the definition's chunk (never split off), but its lines are left out
of `Chunk.code`, the text that is embedded and indexed as code, and are given as `Chunk.doc` instead,
so callers can weigh prose separately (mixed into the code's vector, a documented sibling's wording
outranks the undocumented function a query describes). Doc lines count no tokens toward the budget.

Rules that keep one vector about one thing: a definition is never merged into another's chunk (only
small non-definition spans merge, with non-definition neighbours of the same definition, and a span of
bare punctuation such as a closing brace joins the span before it); a slice of a definition's body, and
a member of an opened container, carries the signatures of the definitions around it in
`Chunk.context`; every chunk that is (part of) a definition names its lines in `Chunk.unit`, so a search
can collapse several slices of one definition into one result.

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

from index.languages import ATTRIBUTES, CONTAINERS, WRAPPERS, definition, language_for, parser_for

TokenCounter = Callable[[Sequence[str]], list[int]]

DEFAULT_BUDGET = 220
# A span under this many tokens is merged into a neighbour when one has room.
MIN_CHUNK_TOKENS = 24
# At most this many lines of a definition's header make its signature (context for its slices).
SIGNATURE_LINES = 3

_WORD = re.compile(r"[A-Za-z]+|\d+|[^\sA-Za-z\d]")
_ALNUM = re.compile(r"\w")
# Comment and docstring markers around doc prose: /** * */ /// //! // # and string quotes.
_DOC_MARKS = re.compile(r'^\s*(?:/\*+!?|\*+/|\*+(?!/)|///?!?|#+|[rRbBuU]?(?:"""|\'\'\'))?\s?')
_DOC_TAIL = re.compile(r'\s*(?:\*+/|"""|\'\'\')\s*$')


def approx_tokens(lines: Sequence[str]) -> list[int]:
    """A tokenizer-free estimate of WordPiece counts: punctuation marks count one each, words one per
    ~5 letters (long identifiers split into several word pieces)."""
    return [sum(1 + (len(w) - 1) // 5 for w in _WORD.findall(line)) for line in lines]


@dataclass(frozen=True)
class Chunk:
    """A run of whole lines of one file. Lines are 1-based and inclusive.

    `text` is every line as in the file; `code` is `text` without its doc lines (what is embedded);
    `doc` is the doc prose, markers removed; `context` the enclosing signatures, one per line;
    `unit` the (first, last) line of the definition the chunk is or belongs to, None for code
    outside definitions; `tokens` counts `code` and `context`."""

    start_line: int
    end_line: int
    symbol: str
    text: str
    tokens: int
    code: str = ""
    doc: str = ""
    context: str = ""
    unit: tuple[int, int] | None = None


@dataclass
class _Piece:
    start: int  # 0-based rows, inclusive
    end: int
    kind: str  # "def", "code", "comment" or "attr"
    symbol: str = ""
    parts: list[_Piece] | None = None  # a definition too big for one chunk (or a container), opened
    ctx: tuple = ()  # ((row, signature), ...) of the opened definitions around it, outermost first
    budget: int = 0  # for an opened definition: the budget of its parts (its signature reserved)


@dataclass
class _Span:
    start: int
    end: int
    symbol: str
    tokens: int = 0
    defs: list[str] = field(default_factory=list)
    unit: tuple[int, int] | None = None
    ctx: tuple = ()


class _Counter:
    """Token counts of row ranges in O(1) from prefix sums."""

    def __init__(self, per_line: list[int]):
        self.prefix = [0, *accumulate(per_line)]

    def __call__(self, start: int, end: int) -> int:
        return self.prefix[end + 1] - self.prefix[start]


@dataclass
class _File:
    lang: str
    lines: list[str]
    tok: _Counter  # doc rows count zero
    full: _Counter  # every row
    doc_rows: set[int]
    count: TokenCounter


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
    spans = None
    doc_rows: set[int] = set()
    lang = language_for(path)
    parser = parser_for(lang) if lang else None
    tok = _Counter(counts)
    if parser is not None:
        tree = parser.parse(text.encode("utf-8", errors="surrogatepass"))
        doc_rows = _doc_rows(tree.root_node, lang, lines)
        code_tok = _Counter([0 if i in doc_rows else n for i, n in enumerate(counts)])
        f = _File(lang, lines, code_tok, tok, doc_rows, count_tokens)
        spans = _syntax_spans(tree.root_node, f, budget)
        tok = code_tok
    if spans is None:
        spans = _line_windows(lines, 0, len(lines) - 1, tok, budget, "")
    ctx_costs: dict[tuple, int] = {}

    def ctx_cost(span: _Span) -> int:
        if span.ctx not in ctx_costs:
            ctx_costs[span.ctx] = sum(count_tokens([sig for _, sig in span.ctx])) if span.ctx else 0
        return ctx_costs[span.ctx]

    spans = _merge_small(spans, tok, budget, min_tokens, lines, ctx_cost)
    out = []
    for s in spans:
        rows = range(s.start, s.end + 1)
        body = "\n".join(lines[s.start:s.end + 1])
        if not body.strip():
            continue
        code = "\n".join(lines[r] for r in rows if r not in doc_rows)
        doc = _doc_text([lines[r] for r in rows if r in doc_rows])
        context = "\n".join(sig for row, sig in s.ctx if not s.start <= row <= s.end)
        ctx_tokens = sum(count_tokens([context])) if context else 0
        out.append(Chunk(s.start + 1, s.end + 1, s.symbol, body, tok(s.start, s.end) + ctx_tokens,
                         code, doc, context,
                         (s.unit[0] + 1, s.unit[1] + 1) if s.unit is not None else None))
    return out


def _doc_text(lines: list[str]) -> str:
    out = []
    for line in lines:
        line = _DOC_TAIL.sub("", _DOC_MARKS.sub("", line, count=1)).strip()
        if line:
            out.append(line)
    return "\n".join(out)


# -- doc comments --------------------------------------------------------------------------------------

def _doc_rows(root, lang: str, lines: list[str]) -> set[int]:
    """Rows holding the doc of some definition: the comments directly above it (attributes may stand
    between) and, in Python, the docstring that opens its body. Only comments alone on their lines."""
    rows: set[int] = set()
    first = root.named_children[0] if root.named_children else None
    if lang == "python" and first is not None and first.type == "expression_statement" \
            and first.named_children and first.named_children[0].type == "string" and _own_lines(first, lines):
        rows.update(range(first.start_point.row, _rows(first)[1] + 1))  # the module's docstring
    stack = [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if definition(node, lang) is None:
            continue
        parent = node.parent
        if parent is None or parent.type not in WRAPPERS:
            top = node.start_point.row
            sib = node.prev_named_sibling
            while sib is not None:
                if sib.type in ATTRIBUTES or ("comment" in sib.type and sib.start_point.row == top):
                    top = sib.start_point.row  # `#[inline]`, or `/*implicit*/` on the definition's line
                elif "comment" in sib.type and _rows(sib)[1] >= top - 1 and _own_lines(sib, lines) \
                        and not sib.text.startswith((b"//!", b"/*!")):
                    top = sib.start_point.row
                    rows.update(range(sib.start_point.row, _rows(sib)[1] + 1))
                else:
                    break
                sib = sib.prev_named_sibling
        if lang == "python":
            inner = _unwrapped(node, lang)
            body = inner.child_by_field_name("body")
            first = body.named_children[0] if body is not None and body.named_children else None
            if first is not None and first.type == "expression_statement" and first.named_children \
                    and first.named_children[0].type == "string" and _own_lines(first, lines) \
                    and first.start_point.row > inner.start_point.row:
                rows.update(range(first.start_point.row, _rows(first)[1] + 1))
    return rows


def _own_lines(node, lines: list[str]) -> bool:
    """Nothing but the node on its lines (a line comment may end at the start of the next row)."""
    (r0, c0), (r1, c1) = node.start_point, node.end_point
    if c1 == 0 and r1 > r0:
        return not lines[r0][:c0].strip()
    return not lines[r0][:c0].strip() and (r1 >= len(lines) or not lines[r1][c1:].strip())


def _unwrapped(node, lang: str):
    while node.type in WRAPPERS:
        inner = next((c for c in node.named_children if definition(c, lang) is not None), None)
        if inner is None:
            break
        node = inner
    return node


def _signature(node, f: _File) -> tuple[int, str]:
    """(first row, one-line text) of a definition's header: from its keyword to its body."""
    inner = _unwrapped(node, f.lang)
    start = inner.start_point.row
    body = inner.child_by_field_name("body")
    end = start
    if body is not None and body.start_point.row > start:
        row = body.start_point.row
        end = row if f.lines[row][:body.start_point.column].strip() else row - 1
    end = min(end, start + SIGNATURE_LINES - 1)
    text = " ".join(f.lines[r].strip() for r in range(start, end + 1) if r not in f.doc_rows)
    return start, text[:200]


def _holds_definitions(node, lang: str) -> bool:
    """A container with definitions among its children or grandchildren (its body's members)."""
    inner = _unwrapped(node, lang)
    if inner.type not in CONTAINERS:
        return False
    for child in inner.children:
        if definition(child, lang) is not None:
            return True
        if any(definition(g, lang) is not None for g in child.children):
            return True
    return False


# -- syntax-aware ------------------------------------------------------------------------------------

def _rows(node) -> tuple[int, int]:
    start, end = node.start_point.row, node.end_point.row
    if node.end_point.column == 0 and end > start:  # ends at the very start of the next line
        end -= 1
    return start, end


def _syntax_spans(root, f: _File, budget: int) -> list[_Span] | None:
    pieces: list[_Piece] = []
    _collect_all(root.children, f, "", (), budget, pieces, 0, len(f.lines) - 1)
    if not pieces:
        return None
    spans = _pack(pieces, "", f.tok, budget)
    return _no_overlap(spans, f.tok, len(f.lines))


def _collect(node, f: _File, scope: str, ctx: tuple, budget: int, out: list[_Piece]) -> None:
    tok = f.tok
    start, end = _rows(node)
    d = definition(node, f.lang)
    if d is not None:
        qual = f"{scope}.{d.name}" if scope else d.name
        if tok(start, end) <= budget and not _holds_definitions(node, f.lang):
            out.append(_Piece(start, end, "def", qual, ctx=ctx))
        else:
            row, sig = _signature(node, f)
            # The signature rides along with every part as context: its tokens come off their budget
            # (a quarter at most; a longer signature is cut).
            cap = max(budget // 4, 1)
            n = f.count([sig])[0]
            while n > cap and sig:
                sig = sig[:len(sig) * cap // (n + 1)]
                n = f.count([sig])[0]
            inner_budget = max(budget - n, 1)
            parts: list[_Piece] = []
            inner_ctx = (*ctx, (row, sig))
            _collect_all(_opened(node, f.lang), f, qual, inner_ctx, inner_budget, parts, start, end)
            out.append(_Piece(start, end, "def", qual, parts, ctx=ctx, budget=inner_budget))
    elif node.child_count == 0 or (tok(start, end) <= budget and not any(
            definition(c, f.lang) is not None for c in node.children)):
        kind = "comment" if "comment" in node.type else "attr" if node.type in ATTRIBUTES else "code"
        out.append(_Piece(start, end, kind, ctx=ctx))
    else:
        _collect_all(node.children, f, scope, ctx, budget, out, start, end)


def _collect_all(children, f: _File, scope: str, ctx: tuple, budget: int, out: list[_Piece],
                 start: int, end: int) -> None:
    """Pieces of a node's children, plus pieces for lines no child covers (children need not tile
    their parent: the text of a string between its escape sequences belongs to no child)."""
    covered = start - 1
    for child in children:
        cs, ce = _rows(child)
        _gap(covered + 1, cs - 1, f.full, out, ctx)
        _collect(child, f, scope, ctx, budget, out)
        covered = max(covered, ce)
    _gap(covered + 1, end, f.full, out, ctx)


def _gap(start: int, end: int, tok: _Counter, out: list[_Piece], ctx: tuple) -> None:
    while start <= end and tok(start, start) == 0:  # blank lines need no chunk
        start += 1
    while end >= start and tok(end, end) == 0:
        end -= 1
    if start <= end:
        out.append(_Piece(start, end, "code", ctx=ctx))


def _opened(node, lang: str) -> list:
    """The children of a definition being split; a wrapper (decorators, export, template) is opened
    through to the definition inside, so the name is not counted twice."""
    out = []
    for child in node.children:
        if definition(child, lang) is not None and definition(node, lang) is not None and \
                node.type in WRAPPERS:
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
            # Comments right above a definition (its doc) and attributes belong to it, whatever the
            # size: doc lines count no tokens, and a doc apart from its code describes nothing.
            lead: list[_Piece] = []
            while cur and (cur[-1].kind == "attr" or cur[-1].kind == "comment" and (
                    tok(cur[-1].start, cur[-1].end) == 0 or cur[-1].start == p.start)) and \
                    cur[-1].end >= (lead[0].start if lead else p.start) - 1:
                lead.insert(0, cur.pop())
            flush()
            unit = (p.start, p.end)
            if p.parts is not None:
                for s in _pack(lead + p.parts, p.symbol, tok, p.budget):
                    if s.unit is None:
                        s.unit = unit  # a slice of this definition (or its header)
                    out.append(s)
            else:
                out.append(_Span(lead[0].start if lead else p.start, p.end, p.symbol, defs=[p.symbol],
                                 unit=unit, ctx=p.ctx))
            continue
        if tok(p.start, p.end) > budget and p.end > p.start:
            # One huge leaf (a long string, a table): line windows, the first one starting with what
            # was pending (a class header stays with the start of its long docstring).
            start = cur[0].start if cur else p.start
            cur.clear()
            for s in _line_windows(None, start, p.end, tok, budget, scope):
                s.ctx = p.ctx
                out.append(s)
            continue
        if cur and tok(min(cur[0].start, p.start), max(cur[-1].end, p.end)) > budget:
            flush()
        cur.append(p)
    flush()
    return out


def _group_span(group: list[_Piece], scope: str, tok: _Counter) -> _Span:
    defs = [p.symbol for p in group if p.kind == "def"]
    return _Span(min(p.start for p in group), max(p.end for p in group), _symbol_for(defs, scope),
                 defs=defs, ctx=group[0].ctx)


def _no_overlap(spans: list[_Span], tok: _Counter, n_lines: int) -> list[_Span]:
    """Several nodes can share a line (`} else {`); each line goes to the first span that has it."""
    out: list[_Span] = []
    last = -1
    for s in sorted(spans, key=lambda s: (s.start, s.end)):
        start = max(s.start, last + 1)
        end = min(s.end, n_lines - 1)
        if start > end:
            continue
        out.append(_Span(start, end, s.symbol, tok(start, end), s.defs, s.unit, s.ctx))
        last = end
    return out


def _merge_small(spans: list[_Span], tok: _Counter, budget: int, min_tokens: int,
                 lines: list[str], ctx_cost: Callable[[_Span], int] = lambda s: 0) -> list[_Span]:
    """Fold spans under `min_tokens` that hold no definition into a neighbour that holds none either
    and belongs to the same definition (the next one preferred: a header joins what follows), when
    the result fits; a span of bare punctuation (a closing brace) joins the span before it."""
    out = list(spans)
    i = 0
    while i < len(out):
        s = out[i]
        s.tokens = tok(s.start, s.end)
        if s.tokens >= min_tokens or s.defs or len(out) == 1:
            i += 1
            continue

        def fits(a: _Span, b: _Span) -> bool:
            return not b.defs and a.unit == b.unit and \
                tok(min(a.start, b.start), max(a.end, b.end)) + ctx_cost(b) <= budget

        nxt = out[i + 1] if i + 1 < len(out) and fits(s, out[i + 1]) else None
        prev = out[i - 1] if i > 0 and fits(s, out[i - 1]) else None
        if prev is None and i > 0 and not any(_ALNUM.search(lines[r]) for r in range(s.start, s.end + 1)) \
                and tok(out[i - 1].start, s.end) + ctx_cost(out[i - 1]) <= budget:
            prev = out[i - 1]  # `}` or `};`: harmless anywhere, pointless alone
            nxt = None
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
                 a.defs + b.defs, keep.unit, keep.ctx)


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
