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

import argparse
import json
import pickle
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from index.code_index import Weights  # noqa: E402
from index.fusion import absolute_sum, rrf, weighted_sum  # noqa: E402

# The six languages of bench/search.py's `multi`: their development halves choose a model's fusion.
# The standard-library sets (jdk, jdk-doc, `quality`) are left out of the choice, to report on.
SIX = ("python", "c", "java", "javascript", "typescript", "rust")


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


def as_weights(method: str, params: tuple) -> Weights:
    """A grid point as the index's fusion setting (minmax has none)."""
    if method == "abs":
        return Weights("abs", params[0], round(1 - params[0], 2), power=float(params[1]))
    if method == "sum":
        return Weights("sum", params[0], round(1 - params[0], 2))
    if method == "rrf":
        return Weights("rrf", params[0], round(1 - params[0], 2), k=float(params[1]))
    raise ValueError(f"{method}: not a fusion the index has")


def _params(w: Weights) -> tuple:
    return (w.dense, w.power) if w.method == "abs" else (w.dense,) if w.method == "sum" else (w.dense, w.k)


def study(cases: list[Case], shipped: Weights | None = None, select: tuple[str, ...] | None = None,
          ) -> tuple[str, tuple]:
    """Prints the dev grid's leaders over the `select` languages (all when None), the configuration
    closest to never falling below its better input in any of them, and `shipped` (default: the
    index's defaults) and the choice on both halves of every language; returns the choice's (method,
    parameters): the best pooled dev MRR@10 among those never below their better input in any selected
    language on dev, else the one whose worst margin is least negative (ties: see below)."""
    langs = sorted({c.lang for c in cases})
    chosen_langs = [lg for lg in langs if select is None or lg in select]
    dev = {lg: [c for c in cases if c.lang == lg and c.dev] for lg in langs}
    test = {lg: [c for c in cases if c.lang == lg and not c.dev] for lg in langs}
    pooled_dev = [c for c in cases if c.dev and c.lang in chosen_langs]

    def inputs(split):
        return {lg: max(mrr(cs, lambda c: c.dense[0]), mrr(cs, lambda c: c.lexical[0])) for lg, cs in split.items()}

    best_in = inputs(dev)
    rows = []
    for method, grid in GRID.items():
        for params, rank in grid:
            per = {lg: mrr(dev[lg], rank) for lg in chosen_langs}
            short = min(per[lg] - best_in[lg] for lg in chosen_langs)
            rows.append((method, params, rank, mrr(pooled_dev, rank), short, per))
    print(f"\nfusion on the dev half of {', '.join(chosen_langs)} ({len(pooled_dev)} queries; MRR@10; "
          "'worst margin' = the lowest, over languages, of fused minus the better input)")
    for method in GRID:
        mine = sorted((r for r in rows if r[0] == method), key=lambda r: -r[3])
        ok = [r for r in mine if r[4] >= 0]
        top = mine[0]
        line = f"  {method:<7} best {top[1]}: {top[3]:.1f} (worst margin {top[4]:+.1f})"
        if ok:
            line += f"; best never below its inputs: {ok[0][1]}: {ok[0][3]:.1f}"
        print(line)
    usable = [r for r in rows if r[0] != "minmax"]  # minmax is not a fusion the index has
    ok = [r for r in usable if r[4] >= 0]
    # Ties (to 0.1 point) go to the larger worst margin, then to `abs`, which keeps the absolute-score
    # property (index/fusion.py), then `sum`.
    pref = {"abs": 2, "sum": 1, "rrf": 0}
    closest = (max(ok, key=lambda r: (round(r[3], 1), round(r[4], 1), pref[r[0]])) if ok else
               max(usable, key=lambda r: (round(r[4], 1), round(r[3], 1), pref[r[0]])))
    print(f"never below its better input in every language on dev: {len(ok)} configurations; the "
          f"closest: {closest[0]} {closest[1]}, dev {closest[3]:.1f}, worst margin {closest[4]:+.1f}")
    w = shipped or Weights()
    params = _params(w)
    mark = next((r for r in rows if r[0] == w.method and r[1] == params), None)
    if mark is not None:
        print(f"shipped: {w.method} {params}, dev {mark[3]:.1f}, worst margin {mark[4]:+.1f}")
    shown = [("shipped", mark or closest), ("chosen", closest)]
    print(f"{'language':<11}{'half':>5}{'n':>4}{'dense':>8}{'lexical':>8}" + "".join(
        f"{f'{n} {r[0]} {r[1]}':>28}" for n, r in shown))
    for name, split in (("dev", dev), ("test", test)):
        for lg in [*langs, "six", "all"]:
            cs = ([c for c in cases if (c.dev == (name == "dev"))] if lg == "all" else
                  [c for c in cases if (c.dev == (name == "dev")) and c.lang in SIX] if lg == "six" else split[lg])
            if not cs:
                continue
            print(f"{lg:<11}{name:>5}{len(cs):4d}{mrr(cs, lambda c: c.dense[0]):8.1f}"
                  f"{mrr(cs, lambda c: c.lexical[0]):8.1f}" + "".join(f"{mrr(cs, r[2]):28.1f}" for _, r in shown))
    for lg in [*langs, "six"]:  # all queries of each set, as the BENCHMARKS tables give them
        cs = [c for c in cases if c.lang in SIX] if lg == "six" else [c for c in cases if c.lang == lg]
        if cs:
            print(f"{lg:<11}{'all':>5}{len(cs):4d}{mrr(cs, lambda c: c.dense[0]):8.1f}"
                  f"{mrr(cs, lambda c: c.lexical[0]):8.1f}" + "".join(f"{mrr(cs, r[2]):28.1f}" for _, r in shown))
    return closest[0], closest[1]


def main(argv: list[str] | None = None) -> None:
    """python bench/search_fusion.py CASES.pkl [--write MODEL_DIR]: study the cases `bench/search.py
    multi` saved (fusion-cases-SLUG.pkl in its work folder) and, with --write, store the choice
    (dev halves of the six languages only) as the model's fusion in its embed.SETTINGS_FILE."""
    from index.embed import SETTINGS_FILE, model_settings

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("cases", type=Path)
    ap.add_argument("--langs", default=",".join(SIX), help="languages whose dev halves choose")
    ap.add_argument("--shipped", help="JSON of the fusion to compare with (default: the index's defaults)")
    ap.add_argument("--write", type=Path, help="a model folder: store the choice in its settings file")
    a = ap.parse_args(argv)
    cases = pickle.loads(a.cases.read_bytes())
    shipped = Weights(**json.loads(a.shipped)) if a.shipped else None
    method, params = study(cases, shipped, tuple(a.langs.split(",")))
    w = as_weights(method, params)
    print(f"chosen: {json.dumps(asdict(w))}")
    if a.write:
        settings = model_settings(a.write)
        settings["fusion"] = asdict(w)
        (a.write / SETTINGS_FILE).write_text(json.dumps(settings, indent=1) + "\n")
        print(f"written {a.write / SETTINGS_FILE}")


def right_ids(ids: set[int], rows, q) -> set[int]:
    return {i for i in ids if i in rows and rows[i].path == q.path and rows[i].start_line <= q.end_line
            and rows[i].end_line >= q.start_line}


if __name__ == "__main__":
    main()
