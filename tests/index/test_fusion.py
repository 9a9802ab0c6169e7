"""Rank fusion and score fusion on hand-made rankings whose fused order can be worked out by hand."""

from __future__ import annotations

import pytest

from index.fusion import rrf, weighted_sum


def test_rrf_rewards_agreement_and_weights_lists():
    dense, lexical = [1, 2, 3], [3, 4, 1]
    fused = dict(rrf([(dense, 1.0), (lexical, 1.0)], k=1))
    # 1: 1/2 + 1/4; 3: 1/4 + 1/2; 2: 1/3; 4: 1/3
    assert fused[1] == pytest.approx(0.75) and fused[3] == pytest.approx(0.75)
    assert [d for d, _ in rrf([(dense, 1.0), (lexical, 1.0)], k=1)] == [1, 3, 2, 4]  # ties by id
    assert [d for d, _ in rrf([(dense, 0.0), (lexical, 1.0)], k=1)] == [3, 4, 1]  # weight 0: ignored


def test_weighted_sum_uses_score_gaps_and_floors_missing_entries():
    dense = ([1, 2], [0.9, 0.45], 0.5)  # normalised: 1 -> 1.0, 2 -> 0.5
    lexical = ([2, 3], [10.0, 1.0], 0.5)  # normalised: 2 -> 1.0, 3 -> 0.1
    fused = dict(weighted_sum([dense, lexical]))
    assert fused[2] == pytest.approx(0.75)  # 0.5 * 0.5 + 0.5 * 1.0
    assert fused[1] == pytest.approx(0.5 * 1.0 + 0.5 * 0.1)  # missing from lexical: its floor
    assert fused[3] == pytest.approx(0.5 * 0.5 + 0.5 * 0.1)
    assert [d for d, _ in weighted_sum([dense, lexical])] == [2, 1, 3]
    # A list with nothing above zero has no opinion.
    assert weighted_sum([dense, ([5], [0.0], 1.0)]) == weighted_sum([dense])
