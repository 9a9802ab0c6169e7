"""Drafting for speculative decoding, without a model: the scanned own-text index answers as the pair index
does, the own text and the cross-request cache vote together, acceptance is learned per unit of confidence,
and the planner prices every draft length by the cost table it learned."""

from __future__ import annotations

import random

import pytest

from serve.engine.drafter import DraftCache, SeqDrafter, SpecConfig, SuffixIndex, TextIndex


def test_the_scanned_index_finds_what_the_pair_index_finds():
    rng = random.Random(3)
    words = [rng.randrange(20) for _ in range(30)]
    text = [w for _ in range(40) for w in rng.sample(words, 6)]  # short phrases that recur, in new orders
    scanned, indexed = TextIndex(text[:50]), SuffixIndex()
    indexed.extend(text[:50])
    for end in range(50, len(text), 7):
        scanned.extend(text[len(scanned) : end])
        indexed.extend(text[len(indexed) : end])
        ctx = text[:end]
        assert scanned.matches(ctx) == indexed.matches(ctx)
        for freq in (True, False):
            a, b = scanned.propose(ctx, 8, frequency=freq), indexed.propose(ctx, 8, frequency=freq)
            assert (a.tokens, a.confidence, a.match) == (b.tokens, b.confidence, b.match)


def test_matches_and_proposals_agree_with_a_token_by_token_walk():
    """`longest` skips candidates that cannot beat the best match found so far, `TextIndex` keys pairs as
    one int64 (extended a token at a time or in chunks) and `frequent_path` takes a lone occurrence's rest
    at once: all must answer as the plain walk over every candidate does."""
    from serve.engine.drafter import MAX_CANDIDATES, MAX_MATCH, SEPARATOR, frequent_path

    def walk(toks, context):  # every occurrence of the last pair, most recent first, extended one by one
        found = [i for i in range(2, len(toks)) if toks[i - 2 : i] == context[-2:]][::-1][:MAX_CANDIDATES]
        best, matched = 0, []
        for i in found:
            m = 0
            while m < min(MAX_MATCH, len(context), i) and toks[i - m - 1] == context[-m - 1]:
                m += 1
            if m > best:
                best, matched = m, [i]
            elif m == best:
                matched.append(i)
        return best, matched

    def path(occ, k):  # the most frequent continuation, one token and one vote at a time
        out, live = [], occ
        for d in range(k):
            counts = {}
            for toks, i in live:
                if i + d < len(toks) and toks[i + d] != SEPARATOR:
                    counts[toks[i + d]] = counts.get(toks[i + d], 0) + 1
            if not counts:
                break
            tok, c = max(counts.items(), key=lambda kv: kv[1])
            out.append((tok, c / len(live)))
            live = [(toks, i) for toks, i in live if i + d < len(toks) and toks[i + d] == tok]
        return out

    rng = random.Random(5)
    for vocab in (3, 6, 40):  # few tokens: dozens of candidates per pair, long matches
        phrases = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 30))] for _ in range(8)]
        text = [t for _ in range(30) for t in rng.choice(phrases)]
        index = TextIndex(text[:3])
        while len(index) < len(text):
            index.extend(text[len(index) : len(index) + (1, 9, 2, 30)[len(index) % 4]])  # a decode step's few tokens, or a chunk
            ctx = text[: len(index)]
            best, matched = index.matches(ctx)
            assert (best, matched) == walk(ctx, ctx)
            for k in (1, 4, 8):
                prop = frequent_path([(ctx, i) for i in matched], k, best)
                assert list(zip(prop.tokens, prop.confidence, strict=True)) == path([(ctx, i) for i in matched], k)
        store = SuffixIndex()  # the cache's store: documents between separators
        for _ in range(20):
            store.extend(rng.choice(phrases) + [SEPARATOR])
        for end in range(5, len(text), 11):
            ctx = text[:end]
            best, matched = store.matches(ctx)
            assert (best, matched) == walk(store.tokens, ctx)


def test_the_own_text_and_the_cache_vote_together_on_equally_long_matches():
    from serve.engine.speculation import propose

    cache = DraftCache(1000)
    cache.add("k", [], [1, 2, 3, 7, 8])
    cache.add("k", [], [1, 2, 3, 7, 8])
    own = [9, 1, 2, 3, 5, 6, 4, 1, 2, 3]  # its own text continued 1 2 3 with 5 6 once
    spec = SeqDrafter(own, "k", 4)
    prop = propose(SpecConfig("suffix"), spec, cache, own, 2)
    assert prop.tokens == [7, 8] and prop.confidence == [pytest.approx(2 / 3), 1.0] and prop.match == 3
    # a longer match in its own text wins alone
    own2 = [4, 1, 2, 3, 5, 6, 4, 1, 2, 3]
    prop = propose(SpecConfig("suffix"), SeqDrafter(own2, "k", 4), cache, own2, 2)
    assert prop.tokens == [5, 6] and prop.match == 4
    # another scope's outputs are never used
    prop = propose(SpecConfig("suffix"), SeqDrafter(own, "other", 4), cache, own, 2)
    assert prop.tokens == [5, 6]


def test_acceptance_is_learned_per_unit_of_confidence():
    spec = SeqDrafter([1, 2, 3], "", 3, prior=0.5)
    assert spec.accept_rate == pytest.approx(0.5)
    for _ in range(10):
        spec.record(4, 4, [1.0] * 4)  # every token kept
    assert spec.accept_rate > 0.9
    low = SeqDrafter([1, 2, 3], "", 3, prior=0.5)
    for _ in range(10):
        low.record(4, 0, [1.0] * 4)  # the first token fails every time
    assert low.accept_rate < 0.2
    # tokens proposed with half the occurrences behind them, kept half the time: a full rate per confidence
    half = SeqDrafter([1, 2, 3], "", 3, prior=0.5)
    for i in range(20):
        half.record(1, i % 2, [0.5])
    assert half.accept_rate > 0.8


def _decoding(tokens: list[int], generated: int = 3):
    from serve.engine.base import SamplingParams
    from serve.engine.sequence import Sequence

    seq = Sequence(list(tokens), SamplingParams(max_tokens=100, temperature=0.0))
    seq.num_computed = len(seq) - 1
    seq.num_prompt_tokens = len(seq) - generated
    return seq


@pytest.mark.parametrize(("verify_ms", "want"), [
    ({1: 4.6, 2: 5.0, 4: 5.4, 8: 5.8}, 8),  # rows get cheap after the first ones: the whole confident draft
    ({1: 7.0, 2: 10.5, 4: 17.5, 8: 31.5}, 0),  # every row costs a whole step: a draft never pays for itself
])
def test_the_plan_prices_every_draft_length_by_what_such_steps_cost(verify_ms, want):
    from serve.engine.speculation import Speculator

    spec = Speculator(SpecConfig("suffix", 8), max_model_len=4096)
    spec.accept_rate = 0.7
    for _ in range(5):
        spec.cost.observe(1, 0.0035, seqs=1)
        for extra, ms in verify_ms.items():
            spec.cost.observe(1 + extra, ms / 1000, seqs=1)
    seq = _decoding([5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 4 + [5, 6, 7])
    spec.plan([seq])
    assert len(seq.draft) == want
    if want:
        assert seq.draft == [8, 9, 10, 11, 12, 13, 14, 5]


@pytest.mark.parametrize(("row_ms", "want"), [(0.05, 8), (50.0, 0)])
def test_a_prefill_drafts_while_a_kept_token_would_save_more_than_its_row_costs(row_ms, want):
    """A sequence about to be prefilled (waiting, nothing computed) gets a draft of its prompt's continuation
    when a prefill row is cheap next to the decode step a kept token saves, and none when it is not; with
    prefill drafts off, none."""
    from serve.engine.base import SamplingParams
    from serve.engine.sequence import Sequence
    from serve.engine.speculation import Speculator

    spec = Speculator(SpecConfig("suffix", 8), max_model_len=4096)
    spec.accept_rate = 0.7
    for _ in range(5):
        spec.cost.observe(1, 0.0035, seqs=1)
        spec.cost.observe_prefill(100, row_ms / 1000 * 100)
    waiting = Sequence([5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 4 + [5, 6, 7], SamplingParams(max_tokens=64))
    spec.plan([], [waiting])
    assert len(waiting.draft) == want
    if want:
        assert waiting.draft == [8, 9, 10, 11, 12, 13, 14, 5]
    off = Speculator(SpecConfig("suffix", 8, prefill=False), max_model_len=4096)
    off.plan([], [waiting])
    assert waiting.draft == []


def test_text_that_never_repeats_is_looked_up_less_and_less_until_a_proposal_is_found():
    from serve.engine.speculation import Speculator

    spec = Speculator(SpecConfig("suffix", 8), max_model_len=4096)
    spec.accept_rate = 0.9
    for _ in range(5):
        spec.cost.observe(1, 0.0035, seqs=1)
        spec.cost.observe(3, 0.0040, seqs=1)
    seq = _decoding(list(range(100, 140)))  # no token occurs twice: nothing to propose
    looked = []
    for step in range(60):
        before = seq.spec.misses if seq.spec is not None else 0
        spec.plan([seq])
        looked.append(seq.spec is not None and (seq.spec.misses != before or step == 0))
        seq.token_ids.append(1000 + step)  # a new token each step, never seen before
        seq.num_computed = len(seq) - 1
    assert all(looked[:8]) and not looked[8]  # the first 8 misses: looked up every step, then not
    assert 10 <= sum(looked) <= 30  # then every 2nd, 4th, 8th step
    seq.token_ids += seq.token_ids[-6:-3]  # now its own text repeats: the next look-up proposes
    seq.num_computed = len(seq) - 1
    for _ in range(8):
        spec.plan([seq])
        if seq.draft:
            break
    assert seq.draft and seq.spec.misses == 0 and seq.spec.idle == 0


def test_where_no_pair_matches_the_last_token_alone_drafts_from_the_scopes_recent_outputs():
    from serve.engine.speculation import propose

    cache = DraftCache(max_tokens=10_000)
    cache.add("alice", [], [40, 7, 41, 42, 43])  # after 7: 41 42 43, then (more recently) 41 44
    cache.add("alice", [], [50, 7, 41, 44])
    cache.add("bob", [], [60, 7, 99])
    text = [1, 2, 3, 4, 5, 7]  # its pair (5, 7) occurs nowhere; 7 alone does, in the outputs
    config = SpecConfig("suffix", 4)
    alice = propose(config, SeqDrafter(text, "alice", 3), cache, text, 4)
    assert (alice.tokens, alice.confidence, alice.match) == ([41, 44], [1.0, 0.5], 1)
    assert propose(config, SeqDrafter(text, "bob", 3), cache, text, 4).tokens == [99]  # its own scope only
    assert propose(config, SeqDrafter(text, "carol", 3), cache, text, 4).tokens == []
    assert propose(config, SeqDrafter(text, "alice", 3), cache, text, 4, fallback=False).tokens == []
    # a pair match wins over the fallback, and the own text's single tokens are never the fallback's
    paired = [5, 7, 8, 1, 5, 7]
    assert propose(config, SeqDrafter(paired, "alice", 3), cache, paired, 4).tokens == [8, 1, 5, 7]
    own = [7, 30, 2, 9, 7]
    assert propose(config, SeqDrafter(own, "carol", 3), cache, own, 4).tokens == []
    # evicted outputs are not proposed from
    small = DraftCache(max_tokens=12)
    small.add("s", [], [7, 41, 42, 43, 44, 45])
    small.add("s", [], [1, 2, 3, 4, 5, 6, 8])
    assert propose(config, SeqDrafter(text, "s", 3), small, text, 4).tokens == []


def test_a_look_up_that_found_only_the_one_token_fallback_still_counts_as_empty():
    from serve.engine.speculation import Speculator, propose

    spec = Speculator(SpecConfig("suffix", 8), max_model_len=4096)
    for t in [139, *range(1000, 1010)]:  # each token the text below ends with once followed by 7
        spec.cache.add("", [], [t, 7])
    seq = _decoding(list(range(100, 140)))
    for step in range(8):
        spec.plan([seq])
        assert propose(spec.config, seq.spec, spec.cache, seq.token_ids, 8).tokens == [7]
        seq.token_ids.append(1000 + step)  # a new token each step, never seen in its own text
        seq.num_computed = len(seq) - 1
    # eight look-ups found a one-token proposal each, yet none was a match of the sequence's text: the
    # backoff for text that never repeats has begun
    assert seq.spec.misses == 8 and seq.spec.idle == 1


def test_a_probe_verifies_a_match_of_the_sequences_text_never_the_one_token_fallback():
    from serve.engine.speculation import Speculator

    spec = Speculator(SpecConfig("suffix", 8), max_model_len=4096)
    spec.accept_rate = 0.01  # acceptance too low to pay: only a probe every 16th token looks
    for _ in range(5):
        spec.cost.observe(1, 0.0035, seqs=1)
        spec.cost.observe(3, 0.0040, seqs=1)
    spec.cache.add("", [], [139, 7])
    lone = _decoding(list(range(100, 140)), generated=16)  # its last token, 139, occurs only in the cache
    spec.plan([lone])
    assert lone.draft == [] and lone.spec is not None  # looked up, found only the fallback's 7: no probe
    paired = _decoding([5, 6, 7, 8, 9] * 5 + [5, 6], generated=16)
    spec.plan([paired])
    assert paired.draft == [7]


def test_a_batch_whose_rows_cost_their_share_neither_drafts_nor_looks():
    from serve.engine.speculation import Speculator

    spec = Speculator(SpecConfig("suffix", 8), max_model_len=4096)
    for _ in range(5):
        spec.cost.observe(8, 0.030, seqs=8)
        spec.cost.observe(16, 0.060, seqs=8)
    batch = [_decoding([5, 6, 7, 8, 9] * 5 + [5, 6], generated=16) for _ in range(8)]  # 16: a probing step
    spec.plan(batch)
    assert all(s.draft == [] and s.spec is None for s in batch)  # not even looked up


def test_the_edit_sessions_open_with_a_read_of_the_lines_around_the_bug():
    from agent.tasks.spec import Task
    from bench.spec_record import READ_BEFORE, READ_LINES, read_turn

    task = Task(id="stdlib-x-1", prompt="fix it", verify="true", workspace="w", meta={"file": "textwrap.py", "line": 395})
    call = read_turn(task)["tool_calls"][0]
    assert call == {"name": "read_file", "arguments": {"path": "textwrap.py", "offset": 395 - READ_BEFORE,
                                                       "limit": READ_LINES}}
    near_top = Task(id="stdlib-x-2", prompt="fix it", verify="true", workspace="w", meta={"file": "a.py", "line": 3})
    assert read_turn(near_top)["tool_calls"][0]["arguments"]["offset"] == 1
