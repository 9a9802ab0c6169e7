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


def test_absolute_sum_lets_a_weak_lexical_list_reorder_nothing():
    from index.fusion import absolute_sum

    dense = ([1, 2, 3], [0.62, 0.60, 0.40], 0.85)
    # BM25's best chunk matches a tenth of what the query could score: weak evidence, the dense
    # order stands (max-normalising would have made chunk 3 the lexical list's full-weight winner).
    weak = ([3, 2], [0.10, 0.01], 0.15)
    assert [d for d, _ in absolute_sum(dense, [weak], 0.5)][:2] == [1, 2]
    # A chunk matching the whole query lexically gets the lexical list's full say.
    strong = ([2, 3], [1.0, 0.2], 0.15)
    fused = absolute_sum(dense, [strong], 0.5)
    assert [d for d, _ in fused][0] == 2
    assert dict(fused)[2] == pytest.approx(0.85 * 0.60 + 0.15 * 1.0)
    assert dict(fused)[1] == pytest.approx(0.85 * 0.62)  # missing from the lexical list: nothing
    # Missing from the dense list: its lowest cosine.
    assert dict(absolute_sum(dense, [([9], [0.25], 0.15)], 1.0))[9] == pytest.approx(0.85 * 0.40 + 0.15 * 0.25)


def test_fusion_is_never_below_its_better_input_on_a_fixture():
    """Queries where one list is right and the other wrong, in both directions; each query's right
    chunk is 7. The shipped fusion ranks 7 at least as high as the better of the two lists does on
    average over the fixture (the property the dev half of the bench checks per language)."""
    from index.code_index import Weights

    cases = [
        # dense right and confident, BM25 matching a few words of a wrong chunk
        (([7, 1, 2], [0.71, 0.55, 0.50]), ([1, 2, 7], [0.25, 0.20, 0.10])),
        (([7, 3], [0.66, 0.50]), ([3], [0.20])),
        # BM25 matching the whole query on the right chunk, dense unsure
        (([1, 7, 2], [0.52, 0.50, 0.49]), ([7, 1], [0.95, 0.20])),
        (([2, 1, 7], [0.48, 0.47, 0.46]), ([7], [0.90])),
    ]

    def mrr(rankings):
        return sum(1 / (r.index(7) + 1) if 7 in r else 0 for r in rankings) / len(rankings)

    w = Weights()
    fused = [[d for d, _ in w.fuse(dense, lexical)] for dense, lexical in cases]
    best_input = max(mrr([dense[0] for dense, _ in cases]), mrr([lexical[0] for _, lexical in cases]))
    assert mrr(fused) >= best_input
    assert mrr(fused) == 1.0  # here it is right every time, where each list alone is not


def test_a_models_fusion_is_chosen_on_dev_halves_and_stored_with_it(tmp_path, capsys):
    """bench/search_fusion.py: the choice uses only the selected languages' dev halves, is never below
    its better input there when some configuration manages it, and `--write` stores it with the model
    next to the weights' fingerprint."""
    import json
    import pickle

    from bench.search_fusion import Case, as_weights, main, study
    from index.code_index import Weights
    from index.embed import SETTINGS_FILE

    right = 7
    dense_right = Case("python", True, ([7, 1, 2], [0.71, 0.55, 0.50]), ([1, 2, 7], [0.25, 0.20, 0.10]), {right})
    lexical_right = Case("rust", True, ([1, 7, 2], [0.52, 0.50, 0.49]), ([7, 1], [0.95, 0.20]), {right})
    # A test-half case and a set outside the choice, both where only BM25 is right: they must not sway it.
    held_out = [Case("python", False, ([1, 2, 7], [0.9, 0.2, 0.1]), ([7], [0.3]), {right}),
                Case("jdk", True, ([1, 2, 7], [0.9, 0.2, 0.1]), ([7], [0.3]), {right})]
    cases = [dense_right, lexical_right, *held_out]
    method, params = study(cases, Weights(), select=("python", "rust"))
    w = as_weights(method, params)
    for c in (dense_right, lexical_right):
        assert [i for i, _ in w.fuse(c.dense, c.lexical)][0] == right
    with pytest.raises(ValueError, match="minmax"):
        as_weights("minmax", (0.5,))
    model = tmp_path / "model"
    model.mkdir()
    (model / SETTINGS_FILE).write_text(json.dumps({"weights_sha256": "e" * 64}))
    (tmp_path / "cases.pkl").write_bytes(pickle.dumps(cases))
    main([str(tmp_path / "cases.pkl"), "--langs", "python,rust", "--write", str(model)])
    stored = json.loads((model / SETTINGS_FILE).read_text())
    assert stored["weights_sha256"] == "e" * 64 and Weights(**stored["fusion"]) == w
    assert "chosen:" in capsys.readouterr().out
