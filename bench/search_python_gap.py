"""Where the Python set of `bench/search.py multi` loses to the naive list, and what would move it (issue 55).

    python bench/search_python_gap.py [--model code-minilm] [--cases FILE]

Saves, once, every set's per-query dense and BM25 lists (per definition, as `semantic_search` fuses them) with
the chunks' text (`--cases`, default WORK/gap-cases-SLUG.pkl; the six languages, jdk, jdk-doc and the `quality`
set, and the `quality` corpus asked for its classes: `class_cases`), then re-ranks them offline: the shipped fusion; the dense list with classes and code outside definitions
left out (what the naive list holds); penalties on classes, on `@property` methods and on tiny chunks; other
fusions of the index's kinds. MRR@10 per set, as differences from the shipped ranking. The queries of these
sets are all functions, so a variant that only demotes classes can only gain here: such a gain is the
benchmark's shape, not a better search, and is printed as a diagnosis, not a candidate.
"""

from __future__ import annotations

import argparse
import pickle
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from index.chunker import approx_tokens  # noqa: E402
from index.code_index import Weights, collapse  # noqa: E402

SETS = ("python", "c", "java", "javascript", "typescript", "rust", "jdk", "jdk-doc", "quality")
CLASS = re.compile(r"^\s*(?:@\w+.*\n\s*)*(?:(?:export|public|abstract|final|private|protected|static|default)\s+)*"
                   r"(?:class|interface|struct|enum)\b")
PROPERTY = re.compile(r"^\s*@property\b")


def save_cases(model: str, out: Path) -> None:
    from bench import corpus as corpus_mod
    from bench import search_eval as se
    from bench.search import DEFAULT_WORK, CachedEmbedder, _slug
    from bench.search_fusion import right_ids
    from index.code_index import CodeIndex, per_definition
    from index.embed import load_embedder

    base = load_embedder(model)
    emb = CachedEmbedder(base, DEFAULT_WORK / "vector-cache" / f"{_slug(base)}.npz")
    data = {}
    for name in SETS:
        if name == "quality":
            root, queries = corpus_mod.build(DEFAULT_WORK)
            ix = CodeIndex(root, model=model)
        else:
            root, queries, _ = se.build(name, DEFAULT_WORK / "multi" / name)
            ix = CodeIndex(root, embedder=emb, index_dir=DEFAULT_WORK / "multi" / name / f"index-{_slug(base)}")
        ix.sync()
        cands = ix.candidates([q.query for q in queries], 100)
        rows = ix.chunks(sorted({i for c in cands for r in c for i in r[0]}))
        cases = []
        for qi, q in enumerate(queries):
            d, lx, _ = per_definition(list(cands[qi]), rows)
            cases.append((d, lx, right_ids({*d[0], *lx[0]}, rows, q)))
        data[name] = (cases, rows)
        ix.close()
        print(f"{name}: {len(cases)} queries", flush=True)
    emb.save()
    out.write_bytes(pickle.dumps(data))


def class_queries() -> list[tuple[str, str, int, int]]:
    """The `quality` corpus's classes as queries: (the first sentence of the class's docstring, its file,
    first line, last line) for each class whose sentence has at least four words and occurs once."""
    import ast
    from collections import Counter

    from bench import corpus as corpus_mod
    from bench.search import DEFAULT_WORK

    root, _ = corpus_mod.build(DEFAULT_WORK)
    src = corpus_mod.stdlib_dir()
    found = []
    for p in corpus_mod.stdlib_files(root):
        rel = p.relative_to(root).as_posix()
        try:
            tree = ast.parse((src / rel).read_text(encoding="utf-8"))
        except (SyntaxError, ValueError, OSError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, ast.ClassDef) else None
            sentence = corpus_mod.first_sentence(doc) if doc else ""
            if len(sentence.split()) >= 4 and sentence[:1].isalpha():
                found.append((sentence, rel, node.lineno, node.end_lineno))
    counts = Counter(q.lower() for q, *_ in found)
    return [f for f in found if counts[f[0].lower()] == 1]


def class_cases(model: str) -> dict:
    """The `quality` corpus (docstrings blanked, classes' too) asked for its classes (`class_queries`).
    Two sets: `classes`, right when a hit holds the `class` line itself (the class's own chunk, not one of
    its methods), and `classes-any`, right when a hit lies anywhere in the class."""
    from bench import corpus as corpus_mod
    from bench.search import DEFAULT_WORK
    from index.code_index import CodeIndex, per_definition

    root, _ = corpus_mod.build(DEFAULT_WORK)
    found = class_queries()
    ix = CodeIndex(root, model=model)
    ix.sync()
    cands = ix.candidates([f[0] for f in found], 100)
    rows = ix.chunks(sorted({i for c in cands for r in c for i in r[0]}))
    out = {"classes": [], "classes-any": []}
    for (_, rel, line, end), c in zip(found, cands, strict=True):
        d, lx, _ = per_definition(list(c), rows)
        ids = {*d[0], *lx[0]}
        for name, hi in (("classes", line), ("classes-any", end)):
            out[name].append((d, lx, {i for i in ids if rows[i].path == rel and
                                       rows[i].start_line <= hi and rows[i].end_line >= line}))
    ix.close()
    print(f"class queries: {len(found)}", flush=True)
    return {name: (cases, rows) for name, cases in out.items()}


def case_queries() -> dict[str, list[tuple[str, str]]]:
    """Each cached set's (query, file), in the cases' order."""
    from bench import corpus as corpus_mod
    from bench import search_eval as se
    from bench.search import DEFAULT_WORK

    out = {n: [(q.query, q.path) for q in se.build(n, DEFAULT_WORK / "multi" / n)[1]] for n in SETS[:8]}
    out["quality"] = [(q.query, q.path) for q in corpus_mod.build(DEFAULT_WORK)[1]]
    out["classes"] = out["classes-any"] = [(q, path) for q, path, _, _ in class_queries()]
    return out


def mrr(cases, rows, queries, adjust=None, fusion: Weights | None = Weights()) -> float:
    """MRR@10 of the fused (or, with fusion None, the dense) list, one result per definition as
    `semantic_search` returns them (the query-kind prior included), after `adjust(chunk id)` is added
    to each dense score."""
    total = 0.0
    for ((d_ids, d_sc), lx, right), (query, _) in zip(cases, queries, strict=True):
        if adjust is not None:
            d_sc = [s + adjust(i) for i, s in zip(d_ids, d_sc, strict=True)]
            order = sorted(range(len(d_ids)), key=lambda k: -d_sc[k])
            d_ids, d_sc = [d_ids[k] for k in order], [d_sc[k] for k in order]
        ids = d_ids if fusion is None else [c for c, _ in fusion.rank(query, (d_ids, d_sc), lx, None, rows)]
        hits = [c for c, _ in collapse([(c, 0.0) for c in ids], rows)[:10]]
        total += next((1 / (pos + 1) for pos, c in enumerate(hits) if c in right), 0.0)
    return 100 * total / max(len(cases), 1)


def main() -> None:
    from bench.search import DEFAULT_WORK

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="code-minilm")
    ap.add_argument("--cases", type=Path)
    a = ap.parse_args()
    path = a.cases or DEFAULT_WORK / f"gap-cases-{a.model.replace('/', '_')}.pkl"
    if not path.exists():
        save_cases(a.model, path)
    data = pickle.loads(path.read_bytes())
    if "classes" not in data:
        data.update(class_cases(a.model))
        path.write_bytes(pickle.dumps(data))
    size = {n: {i: sum(approx_tokens(r.text.splitlines())) for i, r in rows.items()} for n, (_, rows) in data.items()}
    qs = case_queries()
    base = {n: mrr(*data[n], qs[n]) for n in data}
    print("shipped fusion: " + "  ".join(f"{n} {v:.1f}" for n, v in base.items()))
    print("dense list alone: " + "  ".join(f"{n} {mrr(*data[n], qs[n], fusion=None):.1f}" for n in data))
    print("without the query-kind prior: " + "  ".join(
        f"{n} {mrr(*data[n], qs[n], fusion=Weights(kind=0.0)):.1f}" for n in data))

    def row(label, adjust_for=None, fusion=Weights(), dense=False):
        vals = []
        for n, (cases, rows) in data.items():
            adj = adjust_for(n, rows) if adjust_for else None
            vals.append(mrr(cases, rows, qs[n], adj, None if dense else fusion)
                        - (mrr(cases, rows, qs[n], fusion=None) if dense else base[n]))
        print(f"{label:<50}" + "  ".join(f"{n} {v:+.1f}" for n, v in zip(data, vals, strict=True)))

    def functions_only(n, rows):  # what the naive list holds: no classes, no code outside definitions
        return lambda i: -10.0 if i in rows and (not rows[i].unit or CLASS.match(rows[i].text)) else 0.0

    print("\ndifferences from the shipped ranking (dense rows: from the dense list alone)")
    row("dense, classes and outside code left out", functions_only, dense=True)
    row("fused, classes and outside code left out", functions_only)
    for kind, pat in (("classes", CLASS), ("@property methods", PROPERTY)):
        for b in (0.03, 0.1):
            row(f"fused, {kind} -{b}", lambda n, rows, pat=pat, b=b:
                (lambda i: -b if i in rows and pat.match(rows[i].text) else 0.0))
    row("fused, classes and @property methods -1", lambda n, rows: (
        lambda i: -1.0 if i in rows and (CLASS.match(rows[i].text) or PROPERTY.match(rows[i].text)) else 0.0))
    for t in (24, 48):
        for b in (0.02, 0.04):
            row(f"fused, chunks under {t} tokens -{b}*(1-size/{t})", lambda n, rows, t=t, b=b:
                (lambda i: -b * max(0.0, (t - size[n].get(i, t)) / t)))
    for w in (Weights("abs", 0.7, 0.3), Weights("abs", 0.75, 0.25), Weights("abs", 0.6, 0.4),
              Weights("abs", 0.65, 0.35, power=1.5), Weights("abs", 0.65, 0.35, power=2),
              Weights("abs", 0.7, 0.3, power=2), Weights("abs", 0.65, 0.35, power=0.5),
              Weights("rrf", 0.65, 0.35, k=60), Weights("sum", 0.65, 0.35), Weights("sum", 0.75, 0.25)):
        row(f"fusion {w.method} {w.dense}/{w.lexical} p{w.power:g}" + (f" k{w.k:g}" if w.method == "rrf" else ""),
            fusion=w)


if __name__ == "__main__":
    main()
