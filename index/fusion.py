"""Fusing the dense and the lexical ranking into one.

Three methods:
- `absolute_sum` (the default since index format 4): scores as they come, not rescaled per query:
  the dense cosine, and BM25 as a fraction of the query's ceiling (the most any chunk could score,
  lexical.py) raised to a power, `dense_weight * cosine + lexical_weight * fraction ** power`. A
  query whose words the code barely matches thus leans on the dense list by itself, and one whose
  words a chunk matches fully gets the lexical list's say; max-normalising (below) gives the best
  chunk of a weak lexical list the same pull as the best of a strong one.
- `weighted_sum`: each list's scores are divided by that list's best score, then
  combined as `dense_weight * dense + lexical_weight * lexical`; a chunk missing from one list gets that
  list's lowest normalised score among its candidates. It uses how far apart the scores are, which rank
  fusion throws away.
- `rrf`, reciprocal rank fusion (Cormack et al., 2009): sum(weight / (k + rank)), rank from 1. Needs no
  score calibration at all.
bench/search.py (bench/search_fusion.py) tunes them on one half of its queries and reports them on
the other half; the defaults in `code_index.Weights` come from there.
"""

from __future__ import annotations

from collections.abc import Sequence

RRF_K = 60.0


def rrf(rankings: Sequence[tuple[Sequence[int], float]], *, k: float = RRF_K) -> list[tuple[int, float]]:
    """`rankings` is [(ids best first, weight), ...]; returns (id, fused score), best first."""
    scores: dict[int, float] = {}
    for ids, weight in rankings:
        if weight == 0:
            continue
        for rank, doc in enumerate(ids, start=1):
            scores[doc] = scores.get(doc, 0.0) + weight / (k + rank)
    # Ties (same ranks in mirrored lists) break by id so results are deterministic.
    return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))


def weighted_sum(lists: Sequence[tuple[Sequence[int], Sequence[float], float]]) -> list[tuple[int, float]]:
    """`lists` is [(ids best first, their scores, weight), ...]; returns (id, fused score), best first."""
    normed = []
    for ids, scores, weight in lists:
        if weight == 0 or not len(ids) or float(scores[0]) <= 0:
            continue  # nothing scored above zero: this list has no opinion
        top = float(scores[0])
        norm = {int(i): float(s) / top for i, s in zip(ids, scores, strict=True)}
        normed.append((norm, min(norm.values()), weight))
    fused: dict[int, float] = {}
    for doc in {d for norm, _, _ in normed for d in norm}:
        fused[doc] = sum(w * norm.get(doc, floor) for norm, floor, w in normed)
    return sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))


def absolute_sum(dense: tuple[Sequence[int], Sequence[float], float],
                 lexical: Sequence[tuple[Sequence[int], Sequence[float], float]],
                 power: float = 1.0) -> list[tuple[int, float]]:
    """`dense` is (ids best first, cosines, weight); `lexical` lists (ids, scores as a fraction of the
    query's ceiling, weight). Returns (id, fused score), best first. A chunk missing from the dense
    list gets its lowest cosine, one missing from a lexical list nothing."""
    ids, cosines, wd = dense
    floor = float(cosines[-1]) if len(cosines) else 0.0
    fused = {int(i): wd * float(c) for i, c in zip(ids, cosines, strict=True)}
    for l_ids, fractions, wl in lexical:
        if wl == 0:
            continue
        for i, f in zip(l_ids, fractions, strict=True):
            fused[int(i)] = fused.get(int(i), wd * floor) + wl * max(float(f), 0.0) ** power
    return sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))
