"""Fusing the dense and the lexical ranking into one.

Two methods:
- `weighted_sum` (the default): each list's scores are divided by that list's best score, then
  combined as `dense_weight * dense + lexical_weight * lexical`; a chunk missing from one list gets that
  list's lowest normalised score among its candidates. It uses how far apart the scores are, which rank
  fusion throws away.
- `rrf`, reciprocal rank fusion (Cormack et al., 2009): sum(weight / (k + rank)), rank from 1. Needs no
  score calibration at all.
bench/search.py tunes both on one half of its queries and reports both on the other half; the
defaults in `code_index.Weights` come from there.
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
