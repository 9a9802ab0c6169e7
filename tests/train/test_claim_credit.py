"""The evidence penalty credited to the false claims' tokens (train/claim_credit.py, train/rl.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from agent import session as sessions
from agent.tasks.claims import final_answer
from train.algo import LossConfig
from train.claim_credit import clause_positions, credit, last_sampled_run, normalizer_scale, split_claim
from train.rewards import EpisodeStats, RewardConfig, compose, episode_stats
from train.rl import RLConfig, advantages_for, claim_decoder
from train.rollout import Episode
from train.samples import Sample

ROOT = Path(__file__).parents[2]
BUILTIN = ROOT / "serve" / "builtin" / "composer-tiny"
SESSIONS = ROOT / "tests" / "agent" / "tasks" / "sessions"  # real recorded sessions


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(BUILTIN / "tokenizer.json"))


def answer_sample(tok, answer: str, episode: str = "e") -> Sample:
    """A sample whose last sampled run is `answer`, as the built-in model's tokenizer writes it, after
    an earlier sampled turn and a tool result."""
    s = Sample(episode, 0, versions=[0], requests=2)
    s.extend(tok.encode("<prompt> fix the bug").ids, False)
    s.extend(tok.encode("I will run the tests").ids, True, [-0.5] * len(tok.encode("I will run the tests").ids))
    s.extend(tok.encode(" FAILED test_x").ids, False)
    ids = tok.encode(answer).ids
    s.extend(ids, True, [-0.1] * len(ids))
    return s


def test_last_sampled_run():
    assert last_sampled_run([0, 1, 1, 0, 1, 1, 1, 0, 0]) == (4, 7)
    assert last_sampled_run([1, 1]) == (0, 2)
    assert last_sampled_run([0, 0]) is None


def test_the_clause_of_a_real_false_answer_is_found_among_its_tokens(tok):
    data = sessions.load(SESSIONS / "builtin-bugfix-wrong-file.jsonl")
    st = episode_stats(data, False)
    assert st.contradicted_claims == 3 and len(st.false_claims) >= 2
    answer = final_answer(data)
    s = answer_sample(tok, answer)
    dec = claim_decoder(BUILTIN)
    span = last_sampled_run(s.mask)
    pos = clause_positions(s.token_ids, span, st.false_claims, dec)
    assert pos and all(span[0] <= p < span[1] for p in pos)
    claimed = dec([s.token_ids[p] for p in pos])
    for clause in st.false_claims:
        assert clause.strip() in claimed
    assert clause_positions(s.token_ids, span, ["the build is green"], dec) is None  # not in the answer


def test_split_partitions_the_sampled_tokens(tok):
    s = answer_sample(tok, "Fixed `f` in a.py: the operator is corrected and the tests pass.")
    span = last_sampled_run(s.mask)
    rest, claim = split_claim(s, [span[1] - 2, span[1] - 1])
    assert [a + b for a, b in zip(rest.mask, claim.mask, strict=True)] == s.mask
    assert claim.token_ids == s.token_ids and claim.sampler_logprobs == s.sampler_logprobs
    assert sum(claim.mask) == 2
    with pytest.raises(ValueError, match="sampled tokens"):
        split_claim(s, [0])  # a prompt token


def test_credit_puts_the_penalty_on_the_claim_only_and_falls_back_when_not_found(tok):
    dec = claim_decoder(BUILTIN)
    s = answer_sample(tok, "Fixed `f` in a.py: the operator is corrected and the tests pass.")
    pairs, n, logprob = credit([s], 0.25, -0.2, ["the operator is corrected and the tests pass."], dec, weight=3.0)
    assert n > 0 and [a for _, a in pairs] == [0.25, pytest.approx(-0.6)]
    assert sum(pairs[1][0].mask) == n and logprob == pytest.approx(-0.1 * n)  # the answer's tokens: -0.1 each
    pairs, n, _ = credit([s], 0.25, -0.2, ["nowhere in it"], dec, weight=3.0)
    assert n == 0 and [a for _, a in pairs] == [pytest.approx(0.05)]  # the whole episode, as before
    pairs, n, _ = credit([s], 0.25, 0.0, ["the tests pass"], dec, weight=3.0)
    assert n == 0 and [a for _, a in pairs] == [0.25]


def episode(tok, group: int, passed: bool, evidence: float, answer: str, clauses: tuple[str, ...]) -> Episode:
    st = EpisodeStats(passed=passed, status="completed", turns=2, completion_tokens=20, tool_calls=1,
                      malformed_tool_calls=0, tool_calls_per_turn=1.0, infra_error=False, claims=len(clauses),
                      contradicted_claims=len(clauses), false_claims=clauses)
    comps = {"pass": float(passed), "evidence": evidence}
    return Episode("t", group, "completed", passed=passed, reward=sum(comps.values()), components=comps,
                   samples=[answer_sample(tok, answer, f"e{group}-{passed}-{evidence}")], stats=st)


def test_advantages_credit_claims_even_where_every_episode_fails_alike(tok):
    dec = claim_decoder(BUILTIN)
    bad = "the operator is corrected and the tests pass."
    text = "Fixed `f` in a.py: " + bad
    # group 0: all fail with the same false claim (folded: flat, no signal); group 1: one passes honestly
    eps = [episode(tok, 0, False, -0.2, text, (bad,)), episode(tok, 0, False, -0.2, text, (bad,)),
           episode(tok, 1, True, 0.0, "Fixed `f` in a.py.", ()), episode(tok, 1, False, -0.2, text, (bad,))]
    cfg = RewardConfig()
    folded = advantages_for(eps, 0, RLConfig(), LossConfig(), RewardConfig(evidence_on_claims=False), dec)[1]
    assert folded == [0.0, 0.0, pytest.approx(0.6), pytest.approx(-0.6)]
    samples, advs, counts = advantages_for(eps, 0, RLConfig(), LossConfig(), cfg, dec)
    assert counts["claim_credit_episodes"] == 3 and counts["claim_credit_unlocated"] == 0
    assert counts["claim_credit_prob"] == pytest.approx(math.exp(-0.1), abs=1e-4)  # logged per step (rounded)
    assert len(samples) == 7  # 3 episodes split in two
    k = 7 / 4  # the token_sum normaliser grows with the sequences: every advantage scaled back
    assert advs == pytest.approx([0.0, -0.6 * k, 0.0, -0.6 * k, 0.5 * k, -0.5 * k, -0.6 * k])
    # trained tokens are the same, each once
    assert sum(sum(s.mask) for s in samples) == sum(sum(s.mask) for e in eps for s in e.samples)
    # the control (no evidence term) and the shuffled-reward control never split
    off = RewardConfig(evidence_unsupported=0, evidence_contradicted=0)
    zero = [episode(tok, e.group, e.passed, 0.0, text, (bad,)) for e in eps]
    assert len(advantages_for(zero, 0, RLConfig(), LossConfig(), off, dec)[0]) == 4
    assert len(advantages_for(eps, 0, RLConfig(shuffle_rewards=True), LossConfig(), cfg, dec)[0]) == 4


def test_reward_total_still_holds_the_penalty():
    st = episode_stats(sessions.load(SESSIONS / "builtin-bugfix-wrong-file.jsonl"), False)
    total, parts = compose(RewardConfig())(st, None)
    assert parts["evidence"] == pytest.approx(-0.3) and total == pytest.approx(sum(parts.values()))
    with pytest.raises(ValueError, match="true or false"):
        RewardConfig(evidence_on_claims=1)


def test_seq_mean_is_refused_and_token_mean_is_not_rescaled():
    with pytest.raises(ValueError, match="seq_mean"):
        normalizer_scale(4, 7, "seq_mean", None)
    assert normalizer_scale(4, 7, "token_mean", None) == 1.0
    assert normalizer_scale(4, 7, "token_sum", 4096.0) == 1.0
    assert normalizer_scale(4, 7, "token_sum", None) == 7 / 4


def test_a_split_step_has_the_gradient_of_the_unsplit_one(tiny):
    """With the claim's advantage equal to the rest's, the split samples (advantages rescaled as
    advantages_for does) give the trainer's gradient of the one sample: nothing else changes."""
    from train.trainer import Trainer, TrainerConfig

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (40,), generator=gen).tolist()
    mask = [0] * 10 + [1] * 8 + [0] * 10 + [1] * 12
    s = Sample("e", 0, ids, mask, [-2.0 if m else 0.0 for m in mask], [0], 2)
    rest, claim = split_claim(s, list(range(34, 40)))

    def grads(samples, advs):
        t = Trainer(tiny, TrainerConfig(mxfp8_experts=False, seed=0, dtype="float64"))
        t.step(samples, advs)
        return [p.grad.clone() for p in t.params if p.grad is not None]

    one = grads([s], [0.7])
    k = normalizer_scale(1, 2, "token_sum", None)
    two = grads([rest, claim], [0.7 * k, 0.7 * k])
    assert len(one) == len(two) and len(one) > 0
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
