"""Speculative decoding in the native engine: which drafts to verify, and what verification keeps.

A step that verifies is the decode step with several rows per sequence: the sequence's last token and
its k draft tokens, each row a query at its own position whose K/V are written before attention reads
them, so row i sees the draft before it (causal within the draft) with no new kernel. Every row is
sampled exactly as a decode step samples (the same sampler, seeded noise drawn for the draw number the
token would have had without speculation), and the sequence keeps its rows' tokens up to the first one
that differs from the draft, that one included. For a deterministic draft that is the standard
acceptance rule: the token sampled from the target equals the drafted one with the target's probability
of it, and otherwise it is a sample from the target with the drafted token removed. So greedy output is
the token-for-token output without speculation, and a seeded request at any temperature draws the same
tokens (the same noise for the same draw), up to the reduction order of batched kernels. Logprobs, top
logprobs, routed experts and stop tokens come from the rows as from decode steps; rows past the first
mismatch leave K/V in slots that the next tokens overwrite and are never published to the prefix cache.

Draft length is a cost decision made per batch (`Speculator.plan`): each draft token's chance of being
accepted is estimated from the proposal's frequency-based confidence, the length of the match behind it
and the sequence's recent acceptance; a step's time is modelled as a + b x rows, fitted online from the
engine's own decode and verify steps (`StepCost`); tokens are added, most likely first, while the
expected tokens per second of the step grows. Large batches (where a step's rows cost nearly their
share) and text that never repeats (no proposal) verify nothing: the step is a plain decode step.
"""

from __future__ import annotations

import time

import torch

from serve.engine.drafter import MAX_MATCH, DraftCache, Proposal, SeqDrafter, SpecConfig
from serve.engine.sampling import (
    GREEDY_BELOW,
    Pick,
    RowParams,
    needs_filter,
    pack_picks,
    pick_of_row,
    sample_rows,
)
from serve.engine.sequence import Sequence

PROBE_EVERY = 16  # tokens between probes of a sequence whose acceptance is under the bar


class StepCost:
    """Seconds of a decode or verify step as a + b x rows, by exponentially weighted least squares. Until
    the rows have varied enough to fit a slope, b is PRIOR_SLOPE x a."""

    PRIOR_SLOPE = 1 / 32
    DECAY = 0.98

    def __init__(self) -> None:
        self.w = self.t = self.tt = self.y = self.ty = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self.w, self.t, self.tt = d * self.w + 1, d * self.t + rows, d * self.tt + rows * rows
        self.y, self.ty = d * self.y + seconds, d * self.ty + rows * seconds

    def coeffs(self) -> tuple[float, float]:
        if self.w == 0:
            return 1.0, self.PRIOR_SLOPE
        mt, my = self.t / self.w, self.y / self.w
        var = self.tt / self.w - mt * mt
        if var < 0.25:  # rows barely varied: no slope to read
            a = my / (1 + self.PRIOR_SLOPE * mt)
            return a, self.PRIOR_SLOPE * a
        b = max((self.ty / self.w - mt * my) / var, 0.0)
        a = max(my - b * mt, 0.05 * my)
        return a, b


class Speculator:
    """The engine's drafting state: the cross-request cache, the step cost model and the counters that
    /metrics reports. Lives on the engine thread."""

    def __init__(self, config: SpecConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.cache = DraftCache(config.cache_tokens) if config.method == "suffix" else None
        self.cost = StepCost()
        self.drafted = self.accepted = self.verifies = 0  # draft tokens, accepted ones, sequence-steps verifying
        # acceptance per drafted token over recent verifications: a new sequence's prior (agent turns are
        # short, so most of a sequence's life is spent before its own rate says anything)
        self.accept_rate = 0.5
        self.plan_s = 0.0  # the last plan's seconds: part of the step it planned, for the cost model

    # -- drafting --------------------------------------------------------------------------------------

    def plan(self, seqs: list[Sequence]) -> None:
        """Set `draft` on the running sequences that are about to decode (their last token not yet
        computed), or leave it empty, so that the step's expected tokens per second are highest."""
        start = time.perf_counter()
        try:
            self._plan(seqs)
        finally:
            self.plan_s = time.perf_counter() - start

    def _plan(self, seqs: list[Sequence]) -> None:
        decoding = []
        for seq in seqs:
            seq.draft = []
            if seq.num_computed == 0 or seq.num_computed + 1 != len(seq) or seq.cancelled.is_set():
                continue
            decoding.append(seq)
        if not decoding:
            return
        a, b = self.cost.coeffs()
        n = rows = float(len(decoding))
        adaptive = self.config.adaptive
        # the least a draft token must be expected to give: the bar only rises as tokens are added
        bar = b * n / (a + b * rows) if adaptive else 0.0
        if bar >= 1:  # not even a sure token would pay: do not look
            return
        cands: list[tuple[float, int, Sequence, list[int]]] = []
        for seq in decoding:
            k = min(self.config.num_tokens, seq.params.max_tokens - seq.num_generated - 1,
                    self.max_model_len - len(seq))
            if k <= 0:
                continue
            rate = seq.spec.accept_rate if seq.spec is not None else self.accept_rate
            # a sequence whose acceptance cannot clear the bar is not looked up (proposing costs ~0.1 ms a
            # sequence: a tenth of a small batch's step), except every PROBE_EVERY tokens, when one draft
            # token is verified whatever the bar, so that its acceptance keeps being measured
            probe = adaptive and rate <= bar
            if probe and seq.num_generated % PROBE_EVERY:
                continue
            prop = self._propose(seq, 1 if probe else k)
            tokens = prop.tokens
            if seq.matcher is not None and tokens:  # a token the grammar forbids ends the draft
                tokens = tokens[: seq.matcher.validate_tokens(tokens)]
            if probe:
                seq.draft = tokens[:1]
                rows += len(seq.draft)
                continue
            g, trust = 1.0, prop.match / (prop.match + 1) * seq.spec.accept_rate
            for i, c in enumerate(prop.confidence[: len(tokens)]):
                g *= c * trust
                cands.append((g, i, seq, tokens))
        cands.sort(key=lambda c: (-c[0], c[1]))
        for g, i, seq, tokens in cands:
            if len(seq.draft) != i:  # an earlier token of this draft was left out
                continue
            if adaptive and g * (a + b * rows) <= b * n:  # (n + g) / (cost + b) would not beat n / cost
                continue
            seq.draft = tokens[: i + 1]
            n += g
            rows += 1

    def _propose(self, seq: Sequence, k: int) -> Proposal:
        if seq.spec is None:
            seq.spec = SeqDrafter(seq.token_ids, seq.params.draft_scope, seq.num_prompt_tokens)
            seq.spec.accept_rate = self.accept_rate
        spec = seq.spec
        spec.sync(seq.token_ids)
        frequency = self.config.method == "suffix"
        own = spec.index.propose(seq.token_ids, k, frequency=frequency)
        if self.cache is None:
            return own
        other = self.cache.propose(spec.scope, seq.token_ids[-MAX_MATCH:], k)
        return other if (other.expected(), other.match) > (own.expected(), own.match) else own

    # -- after a step ----------------------------------------------------------------------------------

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verifies += 1
        seq.spec.record(drafted, accepted)
        if drafted:
            w = min(0.2, drafted / 40)
            self.accept_rate = (1 - w) * self.accept_rate + w * accepted / drafted

    def finished(self, seq: Sequence) -> None:
        """A sequence is done: its output joins the cross-request cache of its scope."""
        if self.cache is not None and seq.num_generated > 0:
            self.cache.add(seq.params.draft_scope, seq.token_ids[: seq.num_prompt_tokens][-DraftCache.PROMPT_TAIL:],
                           seq.token_ids[seq.num_prompt_tokens:])
        seq.spec = None

    def describe(self) -> str:
        if not self.config.on:
            return ""
        cache = (f", cache of recent outputs {self.config.cache_tokens} tokens (~{self.config.cache_tokens * 64 / 2**20:.0f} "
                 "MiB at most), per API key" if self.cache is not None else "")
        return f"speculative decoding: {self.config.method}, up to {self.config.num_tokens} draft tokens{cache}"


def walk(seq: Sequence, rows: list[list[float]]) -> list[Pick | Exception]:
    """A verifying sequence's rows (its last token's, then one per draft token) to the tokens it keeps:
    each row's pick up to the first that differs from the draft, that one included, or a stop token or a
    failed row. Advances its seed stream by one draw and its grammar by one token per kept row."""
    draft, stops = seq.draft, seq.params.stop_token_ids
    out: list[Pick | Exception] = []
    for i, row in enumerate(rows):
        seq.generator.draws += 1
        pick = pick_of_row(row, seq.params, seq.matcher)
        out.append(pick)
        if isinstance(pick, Exception) or i >= len(draft) or pick[0] != draft[i] or pick[0] in stops:
            break
    return out


def sample_verify(logits_RV: torch.Tensor, seqs: list[Sequence]) -> list[list[float]]:
    """Host-side sampling of a step whose sequences carry drafts (logits: each sequence's 1 + len(draft)
    rows in order): every row's `pack_picks` row, in the same order. Row i draws the noise of draw number
    `draws + i` and, with a grammar, is masked as the grammar stands after the draft's first i tokens."""
    logits_RV = logits_RV.float()
    params, streams, draws = [], [], []
    for seq in seqs:
        n = 1 + len(seq.draft)
        params += [seq.params] * n
        streams += [seq.generator] * n
        draws += [seq.generator.draws + i for i in range(n)]
    allowed_RV = logits_RV
    if any(s.matcher is not None for s in seqs):
        allowed_RV = _masked(logits_RV, seqs)
    sampled = any(p.temperature >= GREEDY_BELOW for p in params)
    rows = RowParams.of(params, streams, logits_RV.device, draws) if sampled else None
    top_n = max((p.top_logprobs for p in params if p.logprobs), default=0)
    return pack_picks(*sample_rows(logits_RV, allowed_RV, rows, sampled=sampled, filtered=needs_filter(params),
                                   top_n=top_n, logprobs=any(p.logprobs for p in params))).tolist()


def _masked(logits_RV: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    from serve.structured import mask_rows

    allowed_RV = logits_RV.clone()
    r = 0
    for seq in seqs:
        n = 1 + len(seq.draft)
        m = seq.matcher
        if m is None:
            r += n
            continue
        consumed = 0
        for i in range(n):
            mask_rows(allowed_RV[r + i : r + i + 1], [m])
            if i < len(seq.draft):
                if not m.consume_token(seq.draft[i]):  # plan() validated it; never past what was valid
                    break
                consumed += 1
        if consumed:
            m.rollback(consumed)
        r += n
    return allowed_RV
