"""The evidence penalty credited to the tokens of the false claim, not to the whole episode (issue 56).

Why. Folded into the episode's reward, the evidence penalty (train/rewards.py) reaches the model through
the group-relative advantage, and there it teaches almost nothing: the claims that are false are mostly
"... and the tests pass." after a failed fix, written by every failing episode of a group alike, so the
penalty either lands on episodes the pass reward already ranks last or shifts a whole group equally
(bench/evidence-rl/diagnose.py measures this). Worse, the same closing in a passing episode shares that
episode's positive advantage, so the pass reward itself keeps teaching the phrase.

What. For an episode whose final answer holds unsupported or contradicted claims, the tokens of those
claims' clauses are split off into a sample of their own (the same token ids, routes and sampler
log-probs; the mask on the clause tokens only, and taken off the episode's sample, so every sampled
token is still trained once) whose advantage is the evidence penalty itself times `weight`:

    claim tokens:       A = weight * evidence_penalty            (<= 0; the baseline is 0, a true answer)
    every other token:  A = the group-relative advantage of the episode's reward without the penalty

The pass reward's advantage is withheld from the claim tokens: the verifier judges the workspace, which
was final before the answer was written, so whatever a claim says cannot change the verdict, and the
outcome's credit there is noise (worse: it is positive on the habitual claim whenever the fix worked).
Each false claim is therefore pushed down in the context it was made in, a failing test run's output for
"the tests pass", in every group, whatever the other episodes did.

Where the clause cannot be found among the answer's tokens (a tokenizer that does not decode back to the
text, an answer that is not the last sampled run), the episode's whole advantage takes the penalty as
before (counted in `claim_credit_unlocated`). Splitting adds samples; with the trainer's default
"token_sum" normaliser (sequences x 1024) every advantage is scaled by new/old sequence count so that the
step's loss is the same function of the same tokens as without the split (`normalizer_scale`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

from train.samples import Sample

Decode = Callable[[list[int]], str]


def last_sampled_run(mask: Sequence[int]) -> tuple[int, int] | None:
    """[start, end) of the last run of sampled tokens (mask 1): the final answer of an episode that ended
    with one. None when nothing was sampled."""
    end = len(mask)
    while end > 0 and not mask[end - 1]:
        end -= 1
    if end == 0:
        return None
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return start, end


def clause_positions(ids: Sequence[int], span: tuple[int, int], clauses: Sequence[str], decode: Decode
                     ) -> list[int] | None:
    """Token positions in ids[span] whose decoded text overlaps one of `clauses`; None if any clause is
    not in the span's text (then the caller falls back to the whole episode)."""
    start, end = span
    piece = list(ids[start:end])
    text = decode(piece)
    ends, last = [], 0
    for k in range(len(piece)):  # character offset where token k's text ends
        last = max(last, len(decode(piece[:k + 1])))
        ends.append(last)
    found: set[int] = set()
    for clause in clauses:
        c = clause.strip()
        i = text.rfind(c) if c else -1  # the answer is at the end: its last occurrence
        if i < 0:
            return None
        j, prev = i + len(c), 0
        for k, e in enumerate(ends):
            if e > i and prev < j:
                found.add(start + k)
            prev = e
    return sorted(found) or None


def split_claim(sample: Sample, positions: Sequence[int]) -> tuple[Sample, Sample]:
    """(the sample without the claim tokens, a sample trained on the claim tokens only); the masks
    partition the original's."""
    pos = set(positions)
    if not pos or any(not sample.mask[p] for p in pos):
        raise ValueError("claim positions must be sampled tokens (mask 1) of the sample")
    rest, claim = copy.copy(sample), copy.copy(sample)
    rest.mask = [0 if i in pos else m for i, m in enumerate(sample.mask)]
    claim.mask = [1 if i in pos else 0 for i in range(len(sample.mask))]
    return rest, claim


def credit(samples: list[Sample], advantage: float, penalty: float, clauses: Sequence[str], decode: Decode,
           weight: float) -> tuple[list[tuple[Sample, float]], int, float]:
    """An episode's (sample, advantage) pairs with the evidence `penalty` (<= 0) on its false claims'
    tokens; `advantage` is the group-relative one of the reward without the penalty. Returns the pairs, the
    number of claim tokens credited (0: not located, the whole episode took the penalty instead) and the
    sum of the sampler's log-probs of those tokens (how sure the policy was of the false claim)."""
    if penalty == 0 or not clauses or not samples:
        return [(s, advantage) for s in samples], 0, 0.0
    last = samples[-1]
    span = last_sampled_run(last.mask)
    pos = clause_positions(last.token_ids, span, clauses, decode) if span else None
    if pos is None:
        return [(s, advantage + penalty) for s in samples], 0, 0.0
    rest, claim = split_claim(last, pos)
    pairs = [(s, advantage) for s in samples[:-1]]
    if any(rest.mask[1:]):
        pairs.append((rest, advantage))
    pairs.append((claim, weight * penalty))
    return pairs, len(pos), float(sum(last.sampler_logprobs[p] for p in pos))


def normalizer_scale(n_before: int, n_after: int, aggregation: str, normalizer: float | None) -> float:
    """What to multiply every advantage by so that splitting samples leaves the loss unchanged: the trainer's
    default "token_sum" normaliser grows with the number of sequences; "token_mean" counts tokens, which
    the split keeps; "seq_mean" weighs sequences, which the split changes (refused)."""
    if aggregation == "seq_mean":
        raise ValueError("the evidence penalty on claim tokens splits samples, which 'seq_mean' weighs "
                         "per sequence: use 'token_sum' or 'token_mean', or evidence_on_claims=false")
    if aggregation == "token_sum" and normalizer is None and n_before:
        return n_after / n_before
    return 1.0
