"""The ranking's settings chosen on the development halves of every set: the fusion and the weight of the
query-kind prior (index/query_kind.py) together (issue 55).

    python bench/search_kind.py [--model code-minilm] [--cases FILE] [--weights 0,0.02,...]
                                [--fusions abs:0.65:1,sum:0.75,...] [--prior table|words|oracle]

Re-ranks the per-query lists `bench/search_python_gap.py` caches (the six languages, jdk, jdk-doc, the Python
standard library's `quality` set and its class queries) with each fusion (`abs:DENSE:POWER` or `sum:DENSE`;
BM25 gets 1 - DENSE) and each weight of the prior, and prints MRR@10 by set and half (halves by file,
`search_eval.is_dev`). The setting chosen is the one with the best MRR@10 over all the development
halves' queries pooled (each query counts once: the sets of 12 to 34 queries move by whole queries, one
query of Java's dev half is 5.6 points); the mean over the sets is printed beside it, and the test halves,
which choose nothing.

`--prior` swaps what the prior knows, to measure the lever rather than to ship it: `table` (what ships,
the first word), `words` (a logistic regression over the first word, every word of the query and its first
two words, trained on the same mined pairs as the table; `--pairs`), or `oracle` (the kind of each
query's right answer: the most any prior on the kind of a definition could give).
"""

from __future__ import annotations

import argparse
import pickle
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.search_fusion import as_weights  # noqa: E402
from bench.search_python_gap import case_queries, mrr  # noqa: E402
from index import query_kind  # noqa: E402
from index.code_index import Weights  # noqa: E402

SETS = ("python", "c", "java", "javascript", "typescript", "rust", "jdk", "jdk-doc", "quality", "classes")


def parse_fusion(spec: str, kind: float) -> Weights:
    """`abs:DENSE:POWER` or `sum:DENSE` as the index's fusion setting, with the prior at `kind`."""
    method, *params = spec.split(":")
    return replace(as_weights(method, tuple(float(x) for x in params)), kind=kind)


def words_prior(pairs_file: Path):
    """`biases` from a logistic regression over the query's words, on the mined first-sentence pairs."""
    import math

    import numpy as np
    from sklearn.feature_extraction import DictVectorizer
    from sklearn.linear_model import LogisticRegression

    from index import embed_mine

    def features(q: str) -> dict[str, int]:
        ws = query_kind._WORD.findall(q.strip().lstrip("\"'`([").lower())
        f = {f"w:{w}": 1 for w in ws[1:12]}
        if ws:
            f["f:" + ws[0]] = 1
        if len(ws) > 1:
            f[f"b:{ws[0]} {ws[1]}"] = 1
        return f

    texts, kinds = [], []
    for query, kind in query_kind.labelled(embed_mine.read(pairs_file)):
        texts.append(query)
        kinds.append(kind == "type")
    vec = DictVectorizer()
    model = LogisticRegression(C=1.0, max_iter=2000).fit(vec.fit_transform([features(q) for q in texts]), kinds)
    pi = float(np.mean(kinds))
    print(f"words prior: {len(texts)} pairs, {len(vec.vocabulary_)} features", flush=True)

    @cache
    def biases(query: str, table=None) -> dict[str, float]:
        p = float(model.predict_proba(vec.transform([features(query)]))[0, 1])
        return {"type": math.log(p / pi), "function": math.log((1 - p) / (1 - pi))}
    return biases


def oracle_prior(data: dict, qs: dict):
    """`biases` that know the kind of each query's right answer (+1 for it, -1 for the other)."""
    known: dict[str, set] = {}
    for n in SETS:
        cases, rows = data[n]
        for (_, _, right), (q, _) in zip(cases, qs[n], strict=True):
            known.setdefault(q, set()).update(query_kind.definition_kind(rows[r].text)
                                               for r in right if r in rows and rows[r].unit)

    def biases(query: str, table=None) -> dict[str, float]:
        kinds = known.get(query, set())
        if len(kinds) != 1:
            return {"type": 0.0, "function": 0.0}
        return {"type": 1.0, "function": -1.0} if kinds == {"type"} else {"type": -1.0, "function": 1.0}
    return biases


def main() -> None:
    from bench.search import DEFAULT_WORK
    from bench.search_eval import is_dev

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="code-minilm")
    ap.add_argument("--cases", type=Path, help="bench/search_python_gap.py's cache for --model (default: "
                    "where it writes it; run it first)")
    ap.add_argument("--weights", default="0,0.02,0.03,0.04,0.05,0.06,0.08")
    ap.add_argument("--fusions", default="abs:0.65:1", help="comma-separated; the first is the shipped one")
    ap.add_argument("--prior", choices=("table", "words", "oracle"), default="table")
    ap.add_argument("--pairs", type=Path, help="--prior words: the mined pairs (default: where "
                    "bench/embedder.py keeps them)")
    a = ap.parse_args()
    data = pickle.loads((a.cases or DEFAULT_WORK / f"gap-cases-{a.model.replace('/', '_')}.pkl").read_bytes())
    qs = case_queries()
    if a.prior == "words":
        from bench.embedder import DEFAULT_WORK as MINED
        from index.embed_mine import REVISION

        query_kind.biases = words_prior(a.pairs or MINED / f"pairs-r{REVISION}.jsonl")
    elif a.prior == "oracle":
        query_kind.biases = oracle_prior(data, qs)
    halves = {(n, h): [i for i, (_, path) in enumerate(qs[n]) if is_dev(path) == (h == "dev")]
              for n in SETS for h in ("dev", "test")}

    def pooled(row, half):
        return sum(row[n, half] * len(halves[n, half]) for n in SETS) / sum(len(halves[n, half]) for n in SETS)

    table: dict[tuple[str, float], dict[tuple[str, str], float]] = {}
    for spec in a.fusions.split(","):
        for kind in (float(x) for x in a.weights.split(",")):
            w = parse_fusion(spec, kind)
            row = {}
            for (n, half), idx in halves.items():
                cases, rows = data[n]
                row[n, half] = mrr([cases[i] for i in idx], rows, [qs[n][i] for i in idx], fusion=w)
            table[spec, kind] = row
            mean = {h: sum(row[n, h] for n in SETS) / len(SETS) for h in ("dev", "test")}
            print(f"{spec:<10} prior {kind:<5g} dev pooled {pooled(row, 'dev'):5.2f} mean {mean['dev']:5.2f}  "
                  f"test pooled {pooled(row, 'test'):5.2f} mean {mean['test']:5.2f}  "
                  + "  ".join(f"{n} {row[n, 'dev']:.1f}/{row[n, 'test']:.1f}" for n in SETS), flush=True)
    spec, kind = max(table, key=lambda k: pooled(table[k], "dev"))
    print(f"chosen on the development halves: {spec}, prior {kind:g}")


if __name__ == "__main__":
    main()
