"""Choosing the fusion of the dense and lexical lists on the dev half of the six-language evaluation.

Each method is a grid of weights; the pick is the configuration with the best pooled dev-half MRR@10
among those that rank at or above the better of their two inputs in every language of the dev half
(the issue's requirement), or when none does, the one whose worst language falls short the least; it
is then reported on the test half, per language, apart. Methods:

    sum     scores divided by each list's best, weighted sum (format 3's fusion)
    rrf     reciprocal rank fusion, weight on the dense list, k
    abs     absolute scores (index/fusion.py absolute_sum): the dense cosine as it is, BM25 divided by
            the query's ceiling (the most any chunk could score, index/lexical.py) to a power, so a
            query whose words the code barely matches leans on the dense list by itself
    minmax  each list's scores mapped to [0, 1] over its candidates, weighted sum
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Prints the dev grid's leaders and the pick on both halves; returns (method, parameters)."""
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
    # Never below the better input in any language if some configuration manages it; else the one
    # that comes closest (its worst language's shortfall the smallest), then the best pooled.
    pick = max(ok, key=lambda r: r[3]) if ok else max(rows, key=lambda r: (round(r[4], 1), r[3]))
    method, params, rank = pick[0], pick[1], pick[2]
    note = ("never below its better input in any language on the dev half" if ok else
            f"NO configuration is never below its inputs on dev; the closest: worst margin {pick[4]:+.1f}")
    print(f"pick: {method} {params}, dev {pick[3]:.1f} ({note})")
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

