"""Reciprocal rank fusion: combine ranked lists by rank alone, so incomparable scores (cosine, BM25)
need no calibration. A document's fused score is sum(weight / (k + rank)) over the lists holding it,
rank starting at 1; k = 60 is the usual constant (Cormack et al., 2009). Weights let one retriever
count more than the other; `bench/search.py` measures which weights help.
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
