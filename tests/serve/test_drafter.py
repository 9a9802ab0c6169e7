"""Drafts from text the server already has (serve/engine/drafter.py) and the step cost model that decides
how many of them to verify (serve/engine/speculation.py)."""

from __future__ import annotations

import pytest

from serve.engine.drafter import SEPARATOR, DraftCache, SpecConfig, SuffixIndex
from serve.engine.speculation import StepCost


def index_of(tokens: list[int]) -> SuffixIndex:
    idx = SuffixIndex()
    idx.extend(tokens)
    return idx


def test_the_longest_match_proposes_what_followed_it():
    # "1 2 3 4 5" then later "9 2 3 ..." and "8 1 2 3": the context ends with 1 2 3, whose longest earlier
    # match (three tokens) is the first occurrence, followed by 4 5
    text = [1, 2, 3, 4, 5, 9, 2, 3, 7, 7, 8, 1, 2, 3]
    prop = index_of(text).propose(text, 4)
    assert prop.tokens == [4, 5, 9, 2]
    assert prop.match == 3
    assert prop.confidence == [1.0, 1.0, 1.0, 1.0]


def test_confidence_is_the_share_of_occurrences_that_agree():
    # "a b" was followed by c three times and by d once: propose c with confidence 3/4, then what the three
    # that agreed went on with
    text = [10, 11, 12, 0, 10, 11, 12, 1, 10, 11, 12, 0, 10, 11, 13, 5, 10, 11]
    prop = index_of(text).propose(text, 2)
    assert prop.tokens[0] == 12 and prop.confidence[0] == pytest.approx(3 / 4)
    assert prop.tokens[1] == 0 and prop.confidence[1] == pytest.approx(2 / 3)
    assert prop.expected() == pytest.approx(3 / 4 + 3 / 4 * 2 / 3)


def test_prompt_lookup_takes_the_most_recent_occurrence_without_frequencies():
    text = [10, 11, 12, 0, 10, 11, 12, 0, 10, 11, 13, 5, 10, 11]
    prop = index_of(text).propose(text, 3, frequency=False)
    assert prop.tokens == [13, 5, 10] and prop.confidence == [1.0, 1.0, 1.0]


def test_nothing_is_proposed_for_text_that_never_repeats():
    text = list(range(100))
    assert index_of(text).propose(text, 8).tokens == []
    assert index_of([]).propose([], 8).tokens == []


def test_a_proposal_never_crosses_a_separator():
    text = [1, 2, 3, SEPARATOR, 4, 5, 1, 2]
    assert index_of(text).propose(text, 5).tokens == [3]


def test_the_cache_keeps_each_scope_to_itself():
    cache = DraftCache(max_tokens=10_000)
    secret = [500, 501, 502, 503, 504, 505, 506]
    cache.add("alice", [1, 2], secret)
    assert cache.propose("alice", [9, 500, 501], 4).tokens == [502, 503, 504, 505]
    assert cache.propose("bob", [9, 500, 501], 4).tokens == []
    cache.add("bob", [], [500, 501, 42])
    assert cache.propose("bob", [500, 501], 4).tokens == [42]
    # the prompt tail kept before an output lets the output's start be drafted from the prompt's end
    assert cache.propose("alice", [7, 1, 2], 2).tokens == [500, 501]


def test_the_cache_stays_within_its_budget_dropping_the_oldest():
    cache = DraftCache(max_tokens=200)
    for i in range(50):
        cache.add("s", [], [1000 + i, 2000 + i, 3000 + i, 4000 + i, 5000 + i])
    assert cache.size <= 200
    assert cache.held_tokens() <= 2 * 200 + 10  # compacted once half of a store is evicted
    assert cache.propose("s", [1049, 2049], 2).tokens == [3049, 4049]  # the newest is there
    assert cache.propose("s", [1000, 2000], 2).tokens == []  # the oldest went


def test_spec_config_names_the_allowed_values():
    with pytest.raises(ValueError, match="suffix, ngram, off"):
        SpecConfig("eagle")
    with pytest.raises(ValueError, match="between 1 and 64"):
        SpecConfig("suffix", 0)
    assert not SpecConfig().on and SpecConfig("ngram").on


def test_the_step_cost_model_fits_a_line_and_falls_back_to_a_prior():
    cost = StepCost()
    for _ in range(20):
        cost.observe(4, 0.010)
    a, b = cost.coeffs()  # rows never varied: the prior slope
    assert b == pytest.approx(StepCost.PRIOR_SLOPE * a) and a + 4 * b == pytest.approx(0.010)
    for rows in (1, 9, 3, 17, 5, 2, 12) * 10:
        cost.observe(rows, 0.005 + 0.0005 * rows)
    a, b = cost.coeffs()
    assert a == pytest.approx(0.005, rel=0.1) and b == pytest.approx(0.0005, rel=0.1)


def _decoding(tokens: list[int]):
    from serve.engine.base import SamplingParams
    from serve.engine.sampling import make_generator
    from serve.engine.sequence import Sequence

    params = SamplingParams(max_tokens=100, temperature=0.0)
    seq = Sequence(list(tokens), params)
    seq.generator = make_generator(params)
    seq.num_computed = len(seq) - 1  # about to decode its last token
    seq.num_prompt_tokens = len(seq) - 3  # three generated: not a probing step (every 16th token)
    return seq


def test_the_plan_drafts_where_it_pays_and_not_where_it_does_not():
    from serve.engine.speculation import Speculator

    repeating = [5, 6, 7, 8, 9, 10, 11, 12] * 6 + [5, 6, 7]
    spec = Speculator(SpecConfig("suffix", 8), max_model_len=4096)
    for _ in range(50):  # a step costs 10 ms plus 0.1 ms a row: extra rows are cheap
        spec.cost.observe(1, 0.0101)
        spec.cost.observe(9, 0.0109)
    one = _decoding(repeating)
    spec.plan([one])
    # as long as each further token's expected gain (confidence x trust, multiplied) beats its row's cost
    assert len(one.draft) >= 4 and one.draft == [8, 9, 10, 11, 12, 5, 6, 7][: len(one.draft)]
    never = _decoding(list(range(100, 160)))
    spec.plan([never])
    assert never.draft == []  # no earlier occurrence: nothing to verify

    pricey = Speculator(SpecConfig("suffix", 8), max_model_len=4096)
    for _ in range(50):  # each row costs as much as the step itself: a batch of 8 gains nothing from drafts
        pricey.cost.observe(8, 0.008)
        pricey.cost.observe(16, 0.016)
    batch = [_decoding(repeating) for _ in range(8)]
    pricey.plan(batch)
    assert all(s.draft == [] for s in batch)
    assert pricey.plan_s < 0.01


def test_fixed_drafting_verifies_every_proposal():
    from serve.engine.speculation import Speculator

    spec = Speculator(SpecConfig("ngram", 4, adaptive=False), max_model_len=4096)
    for _ in range(20):
        spec.cost.observe(8, 0.008)
        spec.cost.observe(16, 0.016)
    batch = [_decoding([5, 6, 7, 8, 9, 10] * 3 + [5, 6]) for _ in range(8)]
    spec.plan(batch)
    assert all(s.draft == [7, 8, 9, 10] for s in batch)
