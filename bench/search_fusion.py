"""Choosing the fusion of the dense and lexical lists on the dev half of the six-language evaluation.

Each method is a grid of weights, scored on the dev half: pooled MRR@10, and its worst language's
margin over the better of its two inputs (the issue asks for a fusion never below it). The shipped
default (`index.code_index.Weights`) is reported per language on both halves. It was chosen on the
dev halves of this set and of `bench/search.py quality` together: here the per-language margins rest
on 2 to 20 queries, and the configuration that comes closest to never falling below (abs, power 6)
lost 5 points on `quality`'s 2,678 dev queries. Methods:

    sum     scores divided by each list's best, weighted sum (format 3's fusion)
    rrf     reciprocal rank fusion, weight on the dense list, k
    abs     absolute scores (index/fusion.py absolute_sum): the dense cosine as it is, BM25 divided by
            the query's ceiling (the most any chunk could score, index/lexical.py) to a power, so a
            query whose words the code barely matches leans on the dense list by itself
    minmax  each list's scores mapped to [0, 1] over its candidates, weighted sum
"""

from __future__ import annotations

from dataclasses import dataclass

from index.code_index import Weights
from index.fusion import absolute_sum, rrf, weighted_sum


@dataclass
class Case:
    lang: str
    dev: bool
    dense: tuple[list[int], list[float]]  # per definition (code_index.per_definition)
    lexical: tuple[list[int], list[float]]  # BM25 as a fraction of the query's ceiling
    right: set[int]  # ids that overlap the answer


def _abs(c: Case, wd: float, power: float) -> list[int]:
    return [i for i, _ in absolute_sum((*c.dense, wd), [(*c.lexical, 1 - wd)], power)]


def _minmax(c: Case, wd: float) -> list[int]:
    fused: dict[int, float] = {}
    for (ids, sc), w in ((c.dense, wd), (c.lexical, 1 - wd)):
        if not ids:
            continue
        hi, lo = float(sc[0]), float(sc[-1])
        for i, s in zip(ids, sc, strict=True):
            fused[i] = fused.get(i, 0.0) + w * ((float(s) - lo) / (hi - lo) if hi > lo else 1.0)
    return [i for i, _ in sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))]


WEIGHTS = [round(0.3 + 0.05 * i, 2) for i in range(13)]  # 0.3 .. 0.9 on the dense list
GRID = {
    "sum": [((wd,), lambda c, wd=wd: [i for i, _ in weighted_sum([(*c.dense, wd), (*c.lexical, 1 - wd)])])
            for wd in WEIGHTS],
    "rrf": [((wd, k), lambda c, wd=wd, k=k: [i for i, _ in rrf([(c.dense[0], wd), (c.lexical[0], 1 - wd)], k=k)])
            for wd in WEIGHTS for k in (5, 20, 60)],
    "abs": [((wd, p), lambda c, wd=wd, p=p: _abs(c, wd, p)) for wd in WEIGHTS for p in (0.5, 1, 2, 4, 6)],
    "minmax": [((wd,), lambda c, wd=wd: _minmax(c, wd)) for wd in WEIGHTS],
}


def mrr(cases: list[Case], rank) -> float:
    total = 0.0
    for c in cases:
        for pos, i in enumerate(rank(c)[:10]):
            if i in c.right:
                total += 1 / (pos + 1)
                break
    return 100 * total / max(len(cases), 1)


def study(cases: list[Case]) -> tuple[str, tuple]:
    """Prints the dev grid's leaders, the configuration closest to never falling below its better
    input in any language, and the shipped default on both halves; returns the latter's (method,
    parameters)."""
    langs = sorted({c.lang for c in cases})
    dev = {lg: [c for c in cases if c.lang == lg and c.dev] for lg in langs}
    test = {lg: [c for c in cases if c.lang == lg and not c.dev] for lg in langs}
    pooled_dev = [c for c in cases if c.dev]
    pooled_test = [c for c in cases if not c.dev]

    def inputs(split):
        return {lg: max(mrr(cs, lambda c: c.dense[0]), mrr(cs, lambda c: c.lexical[0])) for lg, cs in split.items()}

    best_in = inputs(dev)
    rows = []
    for method, grid in GRID.items():
        for params, rank in grid:
            per = {lg: mrr(cs, rank) for lg, cs in dev.items()}
            short = min(per[lg] - best_in[lg] for lg in langs)
            rows.append((method, params, rank, mrr(pooled_dev, rank), short, per))
    print("\nfusion on the dev half (MRR@10; 'worst margin' = the lowest, over languages, of fused minus "
          "the better input)")
    for method in GRID:
        mine = sorted((r for r in rows if r[0] == method), key=lambda r: -r[3])
        ok = [r for r in mine if r[4] >= 0]
        top = mine[0]
        line = f"  {method:<7} best {top[1]}: {top[3]:.1f} (worst margin {top[4]:+.1f})"
        if ok:
            line += f"; best never below its inputs: {ok[0][1]}: {ok[0][3]:.1f}"
        print(line)
    ok = [r for r in rows if r[4] >= 0]
    closest = max(ok, key=lambda r: r[3]) if ok else max(rows, key=lambda r: (round(r[4], 1), r[3]))
    print(f"never below its better input in every language on dev: {len(ok)} configurations; the "
          f"closest: {closest[0]} {closest[1]}, dev {closest[3]:.1f}, worst margin {closest[4]:+.1f}")
    w = Weights()
    params = (w.dense, w.power) if w.method == "abs" else (w.dense,) if w.method == "sum" else (w.dense, w.k)
    shipped = next((r for r in rows if r[0] == w.method and r[1] == params), None)
    if shipped is not None:
        print(f"shipped default (index.code_index.Weights, chosen on this dev half and `quality`'s): "
              f"{w.method} {params}, dev {shipped[3]:.1f}, worst margin {shipped[4]:+.1f}")
    method, params, rank = (shipped or closest)[:3]
    print(f"{'language':<11}{'half':>5}{'n':>4}{'dense':>8}{'lexical':>8}{'fused':>8}")
    for name, split, pooled in (("dev", dev, pooled_dev), ("test", test, pooled_test)):
        for lg in [*langs, "all"]:
            cs = pooled if lg == "all" else split[lg]
            print(f"{lg:<11}{name:>5}{len(cs):4d}{mrr(cs, lambda c: c.dense[0]):8.1f}"
                  f"{mrr(cs, lambda c: c.lexical[0]):8.1f}{mrr(cs, rank):8.1f}")
    return method, params


def right_ids(ids: set[int], rows, q) -> set[int]:
    return {i for i in ids if i in rows and rows[i].path == q.path and rows[i].start_line <= q.end_line
            and rows[i].end_line >= q.start_line}

