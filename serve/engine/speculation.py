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
kept is the product, over it and the tokens before it, of the proposal's frequency-based confidence
times the sequence's learned acceptance per unit of confidence; a step's time for every (batch size,
draft tokens) is learned from the engine's own decode and verify steps (`StepCost`: on a CPU it is far
from linear in rows, the first extra rows hitting new experts); tokens are taken most likely first and
the count kept is the one whose step gives the most expected tokens per second. Large batches (where a
step's rows cost their share) and text that never repeats (no proposal, or acceptance too low to pay)
verify nothing: the step is a plain decode step. A sequence whose look-ups keep finding nothing (text
that never repeats) is looked up less often after 8 empty look-ups in a row, down to every 8th step,
until one finds a proposal. (A look-up that found only the one-token fallback of `propose` counts as
empty here: any token of a large vocabulary recurs in a busy cache.)

A prompt's first tokens are drafted too: a sequence whose prefill ends this step carries a draft after
its prompt (what followed the same prompt tail in recent outputs, or in its own earlier turns), and the
prefill's forward verifies it, causal like the rest of the chunk, so a formulaic opening (`<tool_call>`,
a function name) comes out of the prefill instead of one decode step a token. A draft row in a prefill
costs about a prompt token's share of it (`StepCost.prefill_row`, learned from the engine's prefills)
against a decode step's share saved per kept token, so these drafts are long whenever the proposal is
at all likely.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import torch

from serve.engine.drafter import (
    MAX_MATCH,
    MIN_MATCH,
    DraftCache,
    Proposal,
    SeqDrafter,
    SpecConfig,
    cache_size,
    frequent_path,
)
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


def _bucket(x: int) -> int:
    """Batch sizes and draft totals as kept by StepCost: exact up to 16, then powers of two."""
    return x if x <= 16 else 1 << (x - 1).bit_length()


def _could_pay(q: float, k: int, n: int, factor: list[float]) -> bool:
    """Whether a draft of 1..k tokens, each kept with chance q given those before it were, would give a
    step of n sequences more expected tokens per second than none (the other sequences drafting nothing)."""
    gain, p = 0.0, 1.0
    for m in range(1, k + 1):
        p *= q
        gain += p
        if (n + gain) / factor[m] > n:
            return True
    return False


class StepCost:
    """Seconds of a decode step by (sequences decoding, draft tokens verified), learned from the engine's
    own steps, so that whatever makes rows cheaper (kernels, a GPU, a smaller model) is used without a
    constant to change. Kept as a plain step's time per batch size (an exponential average) and, per
    (batch size, draft tokens), the ratio of a verifying step's time to the plain step's: the ratio is
    the shape of the cost (on a CPU the first extra rows hit new experts and cost most, later ones less),
    and a machine whose load drifts moves the base, not the shape. Draft lengths not seen SEEN times are
    priced between the seen ones (cost never falls with more rows), beyond the longest seen one at the
    last seen slope, and while none is seen at PRIOR_SLOPE of a plain step a row."""

    PRIOR_SLOPE = 1 / 32
    PREFILL_ROW_PRIOR = 1 / 64
    ALPHA = 0.1  # weight of a new observation once a cell is seen
    SEEN = 3

    def __init__(self) -> None:
        self.base: dict[int, list[float]] = {}  # batch bucket -> [seconds, observations]
        self.ratio: dict[int, dict[int, list[float]]] = {}  # batch bucket -> draft bucket -> [ratio, observations]
        self.seqs = 1  # sequences in the step being planned (set by the planner before the step)
        self.prefill: list[float] | None = None  # [seconds per row of a prefill step, observations]
        self._factors: dict[tuple[int, int], list[float]] = {}  # factors(n, upto) since the ratios last changed

    @staticmethod
    def _update(cell: list[float], value: float, alpha: float) -> None:
        if cell[1] >= StepCost.SEEN:  # one stalled step on a shared machine must not move it far
            value = min(max(value, 0.5 * cell[0]), 2.0 * cell[0])
        w = max(alpha, 1.0 / (cell[1] + 1))
        cell[0] += w * (value - cell[0])
        cell[1] += 1

    def observe(self, rows: int, seconds: float, seqs: int | None = None) -> None:
        """A decode step of `rows` query rows over `seqs` sequences (default: the planned batch) took
        `seconds` (its planning included)."""
        n = min(seqs or self.seqs, rows)
        if n <= 0 or seconds <= 0:
            return
        nb, extra = _bucket(n), rows - n
        if extra == 0:
            self._update(self.base.setdefault(nb, [seconds, 0]), seconds, self.ALPHA)
            return
        plain = self.base.get(nb)
        if plain is None or plain[1] < 1:  # no plain step of this batch yet: nothing to relate it to
            return
        cells = self.ratio.setdefault(nb, {})
        self._factors.clear()
        self._update(cells.setdefault(_bucket(extra), [seconds / plain[0], 0]), seconds / plain[0], self.ALPHA)

    def observe_prefill(self, rows: int, seconds: float) -> None:
        """A step of prefill chunks alone (`rows` tokens, draft rows included) took `seconds`."""
        if rows > 0 and seconds > 0:
            if self.prefill is None:
                self.prefill = [seconds / rows, 0]
            self._update(self.prefill, seconds / rows, self.ALPHA)

    def prefill_row(self) -> float:
        """Seconds of one more row in a prefill step (PREFILL_ROW_PRIOR of a plain step until both are seen)."""
        if self.prefill is None or not self.base:
            return self.plain(1) * self.PREFILL_ROW_PRIOR
        return self.prefill[0]

    def plain(self, n: int) -> float:
        """Seconds of a plain decode step of n sequences (1.0 while none was seen: plans only use ratios)."""
        nb = _bucket(n)
        if nb in self.base:
            return self.base[nb][0]
        if not self.base:
            return 1.0
        near = min(self.base, key=lambda b: abs(b - nb))
        return self.base[near][0] * max(nb, 1) / max(near, 1) if near < nb else self.base[near][0]

    def factors(self, n: int, upto: int) -> list[float]:
        """Steps verifying 0..upto draft tokens over n sequences, in plain steps of n (kept until the next
        verifying step is observed: the planner asks every step, and plain steps leave the table as it is;
        the list is shared, not to be changed)."""
        key = (_bucket(n), upto)
        if (out := self._factors.get(key)) is None:
            out = self._factors[key] = self._table(key[0], upto)
        return out

    def _table(self, nb: int, upto: int) -> list[float]:
        seen, lo = {}, 1.0
        for e, c in sorted(self.ratio.get(nb, {}).items()):
            if c[1] >= self.SEEN:
                lo = max(lo, c[0])  # monotone: more rows never cost less
                seen[e] = lo
        points = [(0, 1.0), *sorted(seen.items())]
        # beyond the longest draft seen: the slope of the last stretch seen (on a CPU rows get cheaper as
        # they add fewer new experts, so this errs high), or PRIOR_SLOPE while no draft was seen (cheap
        # rows: drafts get tried, and their lengths vary, so the table fills with what they cost)
        (ea, ra), (eb_, rb) = points[-2] if len(points) > 1 else (0, 1.0), points[-1]
        beyond = (rb - ra) / (eb_ - ea) if eb_ > ea else self.PRIOR_SLOPE
        out, j = [], 0
        for extra in range(upto + 1):
            eb = _bucket(extra) if extra else 0
            while j + 1 < len(points) and points[j + 1][0] <= eb:
                j += 1
            e0, r0 = points[j]
            if e0 == eb:
                out.append(r0)
            elif j + 1 < len(points):
                e1, r1 = points[j + 1]
                out.append(r0 + (r1 - r0) * (eb - e0) / (e1 - e0))
            else:
                out.append(r0 + beyond * (eb - e0))
        return out

    def cost(self, n: int, extra: int) -> float:
        return self.plain(n) * self.factors(n, extra)[extra]


class Speculator:
    """The engine's drafting state: the cross-request cache, the step cost model and the counters that
    /metrics reports. Lives on the engine thread."""

    def __init__(self, config: SpecConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.cache = DraftCache(config.cache_tokens) if config.method == "suffix" else None
        self.cost = StepCost()
        self.drafted = self.accepted = self.verifies = 0  # draft tokens, accepted ones, sequence-steps verifying
        # a drafted token's chance of acceptance per unit of confidence, over recent verifications: a new
        # sequence's prior (agent turns are short, so most of a sequence's life is spent before its own
        # rate says anything)
        self.accept_rate = 0.6
        self.plan_s = 0.0  # the last plan's seconds: part of the step it planned, for the cost model

    # -- drafting --------------------------------------------------------------------------------------

    def plan(self, seqs: list[Sequence], waiting: Iterable[Sequence] = (), budget: int | None = None) -> None:
        """Set `draft` on the running sequences that are about to decode (their last token not yet
        computed), or leave it empty, so that the step's expected tokens per second are highest; and on
        those whose prefill may end this step (running ones still prefilling, then `waiting`, the
        sequences the scheduler may admit), a draft for the prefill to verify, if what is left of its prompt
        fits `budget` (the step's tokens)."""
        start = time.perf_counter()
        try:
            self._plan(seqs, waiting, budget)
        finally:
            self.plan_s = time.perf_counter() - start

    def _plan(self, seqs: list[Sequence], waiting: Iterable[Sequence], budget: int | None) -> None:
        decoding, prefilling = [], []
        for seq in itertools.chain(seqs, waiting):
            seq.draft = []
            if seq.cancelled.is_set():
                continue
            if seq.num_computed > 0 and seq.num_computed + 1 == len(seq):
                decoding.append(seq)
            elif budget is None or len(seq) - seq.num_computed < budget:  # its prefill can end this step
                prefilling.append(seq)
        if prefilling and self.config.prefill:
            self._plan_prefills(prefilling, len(decoding))
        if not decoding:
            return
        n, k_max = len(decoding), self.config.num_tokens
        self.cost.seqs = n
        adaptive = self.config.adaptive
        factor = self.cost.factors(n, n * k_max) if adaptive else [1.0] * (n * k_max + 1)
        # if no number e of sure tokens would pay for its step ((n + e) / factor[e] > n: a large batch on a
        # CPU, where a row costs its share of the step), do not look
        if adaptive and not any(factor[e] < 1 + e / n for e in range(1, n * k_max + 1)):
            return
        cands: list[tuple[float, int, Sequence]] = []
        drafts: dict[int, list[int]] = {}
        for seq in decoding:
            k = min(k_max, self._room(seq))
            if k <= 0:
                continue
            rate = seq.spec.accept_rate if seq.spec is not None else self.accept_rate
            # a sequence whose acceptance could not pay for any draft even at full confidence is not looked
            # up (proposing costs ~0.1 ms a sequence: a tenth of a small batch's step), except every
            # PROBE_EVERY tokens, when one draft token is verified, so that its acceptance keeps being measured
            probe = adaptive and not _could_pay(rate, k, n, factor)
            if probe and seq.num_generated % PROBE_EVERY:
                continue
            if adaptive and seq.spec is not None and seq.spec.idle > 0:  # its recent look-ups found nothing
                seq.spec.idle -= 1
                continue
            prop, tokens = self._proposal(seq, 1 if probe else k, fallback=not probe)
            seq.spec.looked(bool(prop.tokens) and prop.match >= MIN_MATCH)
            seq.spec.confidence = prop.confidence[: len(tokens)]
            if probe or not adaptive:
                seq.draft = tokens[:1] if probe else tokens
                continue
            drafts[seq.id] = tokens
            g, q = 1.0, seq.spec.accept_rate
            for i, c in enumerate(seq.spec.confidence):
                g *= min(1.0, q * c)  # the chance that this token is kept: those before it were, and it is
                cands.append((g, i, seq))
        if not cands:
            return
        # most likely tokens first (a draft's own tokens come in order: each is less likely than the one
        # before); keep the count of tokens whose step gives the most expected tokens per second. The cost
        # is not linear in rows, so every count is priced, not only up to the first that does not pay.
        cands.sort(key=lambda c: (-c[0], c[1]))
        extra = sum(len(s.draft) for s in decoding)  # the probes'
        taken: dict[int, int] = {}
        chosen: list[Sequence] = []
        gain, best, best_value = 0.0, 0, n / factor[min(extra, len(factor) - 1)]
        for g, i, seq in cands:
            if taken.get(seq.id, 0) != i:
                continue
            taken[seq.id] = i + 1
            chosen.append(seq)
            gain += g
            value = (n + gain) / factor[min(extra + len(chosen), len(factor) - 1)]
            if value > best_value:
                best, best_value = len(chosen), value
        for seq in chosen[:best]:
            seq.draft = drafts[seq.id][: len(seq.draft) + 1]

    def _plan_prefills(self, seqs: list[Sequence], decoding: int) -> None:
        """Drafts for prefills: a kept token saves its sequence a decode step's row (a plain step's share
        among the sequences that will decode), a draft row costs a prefill row; tokens are kept in order
        while their chance of being kept times the first exceeds the second."""
        m = decoding + len(seqs)
        saved = self.cost.plain(m) / m
        row = self.cost.prefill_row()
        for seq in seqs:
            k = min(self.config.num_tokens, self._room(seq))
            if k <= 0:
                continue
            prop, tokens = self._proposal(seq, k)
            if self.config.adaptive:
                g, q, keep = 1.0, seq.spec.accept_rate, 0
                for c in prop.confidence[: len(tokens)]:
                    g *= min(1.0, q * c)
                    if g * saved <= row:
                        break
                    keep += 1
                tokens = tokens[:keep]
            seq.spec.confidence = prop.confidence[: len(tokens)]
            seq.draft = list(tokens)

    def _room(self, seq: Sequence) -> int:
        """Draft tokens the sequence can still take: before max_tokens (the step's own token included) and
        the context's end."""
        return min(seq.params.max_tokens - seq.num_generated - 1, self.max_model_len - len(seq))

    def _proposal(self, seq: Sequence, k: int, fallback: bool = True) -> tuple[Proposal, list[int]]:
        """The drafter's proposal of up to k tokens, and its tokens up to the first its grammar forbids."""
        prop = self._propose(seq, k, fallback)
        tokens = prop.tokens
        if seq.matcher is not None and tokens:  # a token the grammar forbids ends the draft
            tokens = tokens[: seq.matcher.validate_tokens(tokens)]
        return prop, tokens

    def _propose(self, seq: Sequence, k: int, fallback: bool = True) -> Proposal:
        if seq.spec is None:
            seq.spec = SeqDrafter(seq.token_ids, seq.params.draft_scope, seq.num_prompt_tokens, self.accept_rate)
        seq.spec.sync(seq.token_ids)
        return propose(self.config, seq.spec, self.cache, seq.token_ids, k, fallback)

    # -- after a step ----------------------------------------------------------------------------------

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verifies += 1
        expected = seq.spec.record(drafted, accepted)
        if expected > 0:  # the engine's rate: a new sequence's prior
            w = min(0.2, expected / 20)
            self.accept_rate += w * (min(1.0, accepted / expected) - self.accept_rate)

    def finished(self, seq: Sequence) -> None:
        """A sequence is done: its output joins the cross-request cache of its scope."""
        if self.cache is not None and seq.num_generated > 0:
            self.cache.add(seq.params.draft_scope, seq.token_ids[: seq.num_prompt_tokens][-DraftCache.PROMPT_TAIL:],
                           seq.token_ids[seq.num_prompt_tokens:])
        seq.spec = None

    def describe(self) -> str:
        if not self.config.on:
            return ""
        n = self.config.cache_tokens
        cache = "" if self.cache is None else (
            f", cache of recent outputs {n} tokens ({cache_size(n)}), per API key" if n else ", no cache of recent outputs")
        return f"speculative decoding: {self.config.method}, up to {self.config.num_tokens} draft tokens{cache}"


def propose(config: SpecConfig, spec: SeqDrafter, cache: DraftCache | None, token_ids: list[int], k: int,
            fallback: bool = True) -> Proposal:
    """A sequence's draft of up to k tokens (its drafter synced to `token_ids`). ngram: prompt lookup in
    its own text. suffix: the longest suffix of its text found in its own text or in the recent outputs
    of its scope; where both hold it equally long, their occurrences together vote on the continuation
    (bench/spec_sim.py replays this). Where neither holds the last two tokens, what followed the last
    token alone in the recent outputs (the token a greedy answer just diverged on, a number before `.`,
    the end of a tool call): the outputs' own habits, where the prompt's single tokens are too many and
    too varied to vote (BENCHMARKS.md, "One-token fallback"). `fallback=False` leaves that out: the plan's
    probes of a sequence whose acceptance is low measure its matches, and on text that never repeats a
    probe would otherwise verify a one-token guess every time."""
    if cache is None:
        return spec.index.propose(token_ids, k, frequency=config.method == "suffix")
    own_m, own = spec.index.matches(token_ids)
    other_m, other, other_toks = cache.matches(spec.scope, token_ids[-MAX_MATCH:])
    if not own and not other:
        if not fallback:
            return Proposal()
        after, toks = cache.follows(spec.scope, token_ids[-1])
        return frequent_path([(toks, i) for i in after], k, 1) if after else Proposal()
    occ = [(spec.index.tokens, i) for i in own] if own_m >= other_m else []
    if other_m >= own_m:
        occ += [(other_toks, i) for i in other]
    return frequent_path(occ, k, max(own_m, other_m))


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
                                   top_n=top_n, logprobs=any(p.logprobs for p in params), host=True)).tolist()


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
