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


def test_the_step_cost_model_learns_each_draft_length_from_the_steps_it_saw():
    cost = StepCost()
    for _ in range(20):  # batch 1: a plain step 4 ms; 2 draft tokens 6 ms, 8 of them 7.5 ms (rows get cheaper)
        cost.observe(1, 0.004, seqs=1)
        cost.observe(3, 0.006, seqs=1)
        cost.observe(9, 0.0075, seqs=1)
    f = cost.factors(1, 12)
    assert f[0] == 1.0 and f[2] == pytest.approx(1.5) and f[8] == pytest.approx(7.5 / 4)
    assert f[1] == pytest.approx(1.25) and f[5] == pytest.approx(1.5 + 3 / 6 * (7.5 / 4 - 1.5))  # between seen ones
    slope = (7.5 / 4 - 1.5) / 6
    assert f[12] == pytest.approx(7.5 / 4 + slope * 4)  # beyond: the last slope seen
    assert cost.cost(1, 8) == pytest.approx(0.0075)
    # load doubles every step: the base follows, the learned shape stays
    for _ in range(60):
        cost.observe(1, 0.008, seqs=1)
    assert cost.cost(1, 0) == pytest.approx(0.008, rel=0.02) and cost.factors(1, 8)[8] == pytest.approx(7.5 / 4)
    # one stalled step (another job took the core) moves a seen cell by at most a bounded step
    cost.observe(9, 1.0, seqs=1)
    assert cost.factors(1, 8)[8] < 7.5 / 4 * 1.15
    # another batch size is its own row of the table; nothing seen yet: the prior, cheap rows
    assert cost.factors(8, 2)[2] == pytest.approx(1 + 2 * StepCost.PRIOR_SLOPE)
    for _ in range(5):
        cost.observe(8, 0.02, seqs=8)
        cost.observe(16, 0.04, seqs=8)  # 8 sequences x 1 draft token: twice a plain step
    assert cost.factors(8, 8)[8] == pytest.approx(2.0) and cost.factors(8, 8)[4] == pytest.approx(1.5)


def test_the_cost_never_falls_with_more_rows():
    cost = StepCost()
    for _ in range(5):
        cost.observe(1, 0.004, seqs=1)
        cost.observe(5, 0.008, seqs=1)
        cost.observe(7, 0.006, seqs=1)  # noise: fewer seconds for more rows
    f = cost.factors(1, 8)
    assert all(b >= a for a, b in zip(f, f[1:], strict=False))


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
        spec.cost.observe(1, 0.0101, seqs=1)
        spec.cost.observe(9, 0.0109, seqs=1)
    one = _decoding(repeating)
    spec.plan([one])
    # as long as each further token's expected gain (its chance of being kept) beats its row's cost
    assert len(one.draft) >= 4 and one.draft == [8, 9, 10, 11, 12, 5, 6, 7][: len(one.draft)]
    never = _decoding(list(range(100, 160)))
    spec.plan([never])
    assert never.draft == []  # no earlier occurrence: nothing to verify

    pricey = Speculator(SpecConfig("suffix", 8), max_model_len=4096)
    for _ in range(50):  # each row costs its share of the step: a batch of 8 gains nothing from drafts
        pricey.cost.observe(8, 0.008, seqs=8)
        pricey.cost.observe(16, 0.016, seqs=8)
    batch = [_decoding(repeating) for _ in range(8)]
    pricey.plan(batch)
    assert all(s.draft == [] for s in batch)
    assert pricey.plan_s < 0.01


def test_fixed_drafting_verifies_every_proposal():
    from serve.engine.speculation import Speculator

    spec = Speculator(SpecConfig("ngram", 4, adaptive=False), max_model_len=4096)
    for _ in range(20):
        spec.cost.observe(8, 0.008, seqs=8)
        spec.cost.observe(16, 0.016, seqs=8)
    batch = [_decoding([5, 6, 7, 8, 9, 10] * 3 + [5, 6]) for _ in range(8)]
    spec.plan(batch)
    assert all(s.draft == [7, 8, 9, 10] for s in batch)
