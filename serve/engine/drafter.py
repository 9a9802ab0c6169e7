"""Drafts for speculative decoding from text the server already has: no second model.

Agent output is mostly copies: an edit's `old_string` repeats lines the model just read, `new_string`
repeats most of them again, paths and identifiers recur across turns, and an RL group's samples share
most of their answers. So the next tokens are usually a continuation of some earlier occurrence of
the sequence's last few tokens, in its own prompt and output or in a recent request's output.

`SuffixIndex` finds those occurrences: a token store with, for every position, the pair of tokens
before it as a key (a suffix tree cut at depth 2, kept as positions). A query takes the positions after
the context's last two tokens, extends each match backwards (up to MAX_MATCH tokens) to find the
longest suffix of the context that occurs before, and reads what followed each of its occurrences:
their continuations form the frequency tree a suffix tree's node holds below the match. The draft
follows the most frequent branch; each token's confidence is its share of the occurrences still
agreeing, so text seen once proposes with less weight than text that recurs. Each position is also
kept under the one token before it (`follows`): where no pair matches, the recent outputs still say what
usually follows the last token alone. Indexing is two dict appends per token (1-5 µs a token on the
2-core machine), which is why it is positions and not a built tree: building a tree per request cost
more than every query it answered.

Two sources feed a sequence's draft: its own prompt and output (`TextIndex`, scanned rather than indexed:
a prompt of thousands of tokens would otherwise be indexed on the request's first decode step) and
`DraftCache`, the outputs of recent finished requests (each with the prompt tail before it), bound by a
token budget and kept per scope (a tenant's API key), so one user's text never drafts another's. The
longer match of the two wins; where both match equally long, their occurrences vote together
(serve/engine/speculation.propose). `method="ngram"` is prompt lookup, the simple baseline: the
sequence's own text only, the most recent occurrence of the longest match, no frequencies.

How many tokens to verify is decided per batch by `plan` (serve/engine/speculation.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

MIN_MATCH = 2  # context tokens that must match before anything is proposed
MAX_MATCH = 24  # how far back a match is extended (longer matches are not more telling)
MAX_CANDIDATES = 48  # most recent occurrences of the context's last pair considered per query
SEPARATOR = -1  # between documents in a store: no match or continuation crosses it
PAIR_SHIFT = 32  # a pair of token ids as one int64 key: (left << PAIR_SHIFT) | right (ids are below 2**31)


@dataclass
class Proposal:
    """Up to k draft tokens; `confidence[i]`: the share of the matched occurrences that continued with
    tokens[i], among those that agreed up to it (1.0 for a single occurrence)."""

    tokens: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    match: int = 0  # length of the context suffix that matched

    def expected(self) -> float:
        """Expected accepted tokens if every confidence were the acceptance probability."""
        total, p = 0.0, 1.0
        for c in self.confidence:
            p *= c
            total += p
        return total


METHODS = ("suffix", "ngram", "off")
DEFAULT_TOKENS = 8
"""Draft tokens per sequence at most (--num-speculative-tokens): measured on the edit-heavy replay of
bench/spec.py (BENCHMARKS.md, "Speculative decoding")."""
DEFAULT_CACHE_TOKENS = 1 << 18
"""Tokens of recent outputs kept for drafting, over all tenants."""
CACHE_BYTES = (70, 640)
"""The cache's memory per token of its budget (tracemalloc): on agent outputs (pairs and tokens recur), and
at most, on text that never repeats in a large vocabulary with every store at twice its live tokens."""


def cache_size(tokens: int) -> str:
    """The memory a cache of `tokens` takes, for start-up and --help."""
    typical, most = (tokens * b / 2**20 for b in CACHE_BYTES)
    return f"~{typical:.0f} MiB on agent text, {most:.0f} MiB at most"


@dataclass(frozen=True)
class SpecConfig:
    method: str = "off"
    """suffix: the sequence's own text and recent requests' outputs, frequency-weighted; ngram: prompt
    lookup in the sequence's own text; off."""
    num_tokens: int = DEFAULT_TOKENS
    """Most draft tokens one sequence verifies in one step."""
    cache_tokens: int = DEFAULT_CACHE_TOKENS
    """Budget of the cross-request cache (suffix only; 0: none)."""
    adaptive: bool = True
    """Draft only where verifying is expected to pay (the step cost model); False: verify every proposal
    up to num_tokens (for measuring acceptance, and tests that must see drafts whatever the timings)."""
    prefill: bool = True
    """Draft a prompt's first tokens too, verified in its prefill's forward."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if not 1 <= self.num_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be between 1 and 64, not {self.num_tokens}")
        if self.cache_tokens < 0:
            raise ValueError(f"the speculative cache's token budget must be >= 0, not {self.cache_tokens}")

    @property
    def on(self) -> bool:
        return self.method != "off"


class SuffixIndex:
    """A token store searchable by suffix (module docstring). Append-only; positions are absolute so a
    bounded store can drop its oldest tokens (`trim`) without renumbering."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.offset = 0  # absolute position of tokens[0]
        self.after: dict[tuple[int, int], list[int]] = {}  # (t[i-2], t[i-1]) -> absolute positions i
        self.single: dict[int, list[int]] = {}  # t[i-1] -> absolute positions i (the one-token fallback)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        toks, after, single = self.tokens, self.after, self.single
        for t in new:
            n = len(toks)
            if n and (prev := toks[n - 1]) != SEPARATOR:
                pos = n + self.offset
                lst = single.get(prev)
                if lst is None:
                    single[prev] = [pos]
                else:
                    lst.append(pos)
                if n >= 2 and toks[n - 2] != SEPARATOR:
                    key = (toks[n - 2], prev)
                    lst = after.get(key)
                    if lst is None:
                        after[key] = [pos]
                    else:
                        lst.append(pos)
            toks.append(t)

    def trim(self, keep: int) -> None:
        """Drop the oldest tokens, keeping the last `keep`; index entries are rebuilt (amortised: callers
        trim when the store has grown well past its budget)."""
        drop = len(self.tokens) - keep
        if drop <= 0:
            return
        kept = self.tokens[drop:]
        self.tokens, self.offset, self.after, self.single = [], self.offset + drop, {}, {}
        self.extend(kept)

    def propose(self, context: list[int], k: int, frequency: bool = True, start: int = 0) -> Proposal:
        """Up to k tokens continuing `context`, whose last MIN_MATCH.. tokens are matched against the store
        (the context may be the store's own text: its own end is not in the index yet, so it never
        matches itself). Occurrences before absolute position `start` are left out (evicted text)."""
        if k <= 0:
            return Proposal()
        best, matched = self.matches(context, start)
        if not matched:
            return Proposal()
        if not frequency:  # prompt lookup: the most recent occurrence of the longest match
            out = _take(self.tokens, matched[0], k)
            return Proposal(out, [1.0] * len(out), best)
        return frequent_path([(self.tokens, i) for i in matched], k, best)

    def matches(self, context: list[int], start: int = 0) -> tuple[int, list[int]]:
        """The longest suffix of `context` (MIN_MATCH..MAX_MATCH tokens) that occurs in the store, and the
        indexes (into `tokens`) just after its occurrences, most recent first (at most MAX_CANDIDATES
        occurrences of the last MIN_MATCH tokens are looked at)."""
        if len(context) < MIN_MATCH:
            return 0, []
        cands = self.after.get((context[-2], context[-1]))
        if not cands:
            return 0, []
        first = max(start + 2, self.offset)  # evicted text (or a match that would start in it) is left out
        recent = cands[: -MAX_CANDIDATES - 1 : -1]  # most recent first: the oldest last
        if self.offset or recent[-1] < first:
            recent = [p - self.offset for p in recent if p >= first]
        return longest(self.tokens, recent, context)

    def follows(self, token: int, start: int = 0) -> list[int]:
        """Indexes (into `tokens`) just after the occurrences of one token, most recent first (at most
        MAX_CANDIDATES; none before absolute position `start`): the fallback where no pair matches."""
        cands = self.single.get(token)
        if not cands:
            return []
        first = max(start + 1, self.offset)
        return [p - self.offset for p in cands[: -MAX_CANDIDATES - 1 : -1] if p >= first]


def longest(toks: list[int], cands, context: list[int]) -> tuple[int, list[int]]:
    """Of candidate indexes i (toks[i-2:i] == context[-2:]), those whose match with the end of `context`
    is longest (up to MAX_MATCH tokens), in the order given, and that length. Once a match of `best`
    tokens is found, a candidate is first compared over its last `best` tokens in one slice comparison:
    most candidates of a common pair fall short there, without a token-by-token walk. (A context holds
    token ids only, never SEPARATOR, so no match crosses one.)"""
    best, matched, n_ctx = 0, [], len(context)
    for i in cands:
        limit = min(MAX_MATCH, n_ctx, i)
        if best > MIN_MATCH:
            if limit < best or toks[i - best : i] != context[n_ctx - best :]:
                continue  # shorter than the best match so far
            m = best
        else:
            m = MIN_MATCH
        while m < limit and toks[i - m - 1] == context[-m - 1]:
            m += 1
        if m > best:
            best, matched = m, [i]
        elif m == best:
            matched.append(i)
    return best, matched


class TextIndex:
    """A sequence's own text (prompt and output so far), searched by a scan instead of an index: building
    SuffixIndex's pair index costs ~5 µs a token, so a 1,400-token prompt cost 7 ms on the request's first
    decode step (two steps of the built-in model); a vectorised scan for the context's last pair (each
    pair kept as one int64 key) costs ~10-20 µs a query at 16k tokens. Same queries as SuffixIndex
    (`propose`, `matches`)."""

    def __init__(self, token_ids: list[int]):
        self.tokens: list[int] = []
        # pairs[j]: tokens j and j + 1 as one key (PAIR_SHIFT), so a query is one comparison, not two and an and
        self.pairs = np.empty(max(64, 2 * len(token_ids)), dtype=np.int64)
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        n, m = len(self.tokens), len(new)
        if not m:
            return
        if n + m > len(self.pairs):
            grown = np.empty(2 * (n + m), dtype=np.int64)
            grown[:n] = self.pairs[:n]
            self.pairs = grown
        # the key of each pair that ends in a new token (the first pairs the last old token with it)
        if n and m <= 8:  # a decode step's few tokens: numpy's fixed cost would be most of the time
            prev = self.tokens[-1]
            for j, t in enumerate(new, n - 1):
                self.pairs[j] = (prev << PAIR_SHIFT) | t
                prev = t
        else:
            ids = np.asarray(new if not n else [self.tokens[-1], *new], dtype=np.int64)
            self.pairs[max(n - 1, 0) : n + m - 1] = (ids[:-1] << PAIR_SHIFT) | ids[1:]
        self.tokens.extend(new)

    def matches(self, context: list[int], start: int = 0) -> tuple[int, list[int]]:
        n = len(self.tokens)
        if len(context) < MIN_MATCH or n < 3:
            return 0, []
        # pairs (j, j+1) before the text's own last pair; the continuation starts at j + 2
        hits = np.flatnonzero(self.pairs[: n - 2] == ((context[-2] << PAIR_SHIFT) | context[-1]))
        if not len(hits):
            return 0, []
        recent = (hits[: -MAX_CANDIDATES - 1 : -1] + 2).tolist()
        return longest(self.tokens, recent, context)

    propose = SuffixIndex.propose


def _take(toks: list[int], i: int, k: int) -> list[int]:
    out = toks[i : i + max(k, 0)]
    if SEPARATOR in out:
        out = out[: out.index(SEPARATOR)]
    return out


def frequent_path(occurrences: list[tuple[list[int], int]], k: int, match: int) -> Proposal:
    """Follow the most frequent continuation of the occurrences (a store's tokens, the index after the
    match), up to k tokens; each token's confidence is its share of the occurrences still agreeing."""
    prop = Proposal(match=match)
    live, depth = occurrences, 0
    while live and depth < k:
        if len(live) == 1:  # one occurrence left: the rest of its continuation, each token sure
            toks, i = live[0]
            rest = _take(toks, i + depth, k - depth)
            prop.tokens += rest
            prop.confidence += [1.0] * len(rest)
            break
        counts: dict[int, int] = {}
        for toks, i in live:
            if i + depth < len(toks) and (t := toks[i + depth]) != SEPARATOR:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        tok, c = max(counts.items(), key=lambda kv: kv[1])
        prop.tokens.append(tok)
        prop.confidence.append(c / len(live))
        if c < len(live):  # some occurrence went another way, or ended
            live = [(toks, i) for toks, i in live if i + depth < len(toks) and toks[i + depth] == tok]
        depth += 1
    return prop


class DraftCache:
    """Recent requests' outputs per scope, for other requests' drafts. Bounded by `max_tokens` over all
    scopes together: the oldest documents go first (a scope's store is compacted once half of it is
    evicted, so it holds at most twice its live tokens)."""

    PROMPT_TAIL = 8  # prompt tokens kept before each output: its first tokens follow them

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.stores: dict[str, SuffixIndex] = {}
        self.dead: dict[str, int] = {}  # per scope: evicted tokens still in its store
        self.docs: deque[tuple[str, int]] = deque()  # (scope, tokens), oldest first
        self.size = 0

    def add(self, scope: str, prompt_tail: list[int], output: list[int]) -> None:
        if self.max_tokens <= 0 or not output:
            return
        doc = (list(prompt_tail[-self.PROMPT_TAIL:]) + list(output))[-(self.max_tokens - 1):] + [SEPARATOR]
        self.stores.setdefault(scope, SuffixIndex()).extend(doc)
        self.docs.append((scope, len(doc)))
        self.size += len(doc)
        while self.size > self.max_tokens:
            s, n = self.docs.popleft()
            self.size -= n
            self.dead[s] = self.dead.get(s, 0) + n
            live = len(self.stores[s]) - self.dead[s]
            if live <= 0:
                del self.stores[s], self.dead[s]
            elif self.dead[s] > live:
                self.stores[s].trim(live)
                self.dead[s] = 0

    def propose(self, scope: str, context: list[int], k: int) -> Proposal:
        store = self.stores.get(scope)
        if store is None:
            return Proposal()
        return store.propose(context, k, start=self.start(scope))

    def matches(self, scope: str, context: list[int]) -> tuple[int, list[int], list[int]]:
        """SuffixIndex.matches in a scope's store: (match length, indexes, the store's tokens)."""
        store = self.stores.get(scope)
        if store is None:
            return 0, [], []
        best, found = store.matches(context, self.start(scope))
        return best, found, store.tokens

    def follows(self, scope: str, token: int) -> tuple[list[int], list[int]]:
        """SuffixIndex.follows in a scope's store: (indexes, the store's tokens)."""
        store = self.stores.get(scope)
        if store is None:
            return [], []
        return store.follows(token, self.start(scope)), store.tokens

    def start(self, scope: str) -> int:
        store = self.stores[scope]
        return store.offset + self.dead.get(scope, 0)

    def held_tokens(self) -> int:
        return sum(len(s) for s in self.stores.values())


class SeqDrafter:
    """One sequence's own text (prompt and output so far), indexed as it grows, and its acceptance.

    `accept_rate` is the chance that a drafted token is accepted given that the tokens before it were,
    per unit of the proposal's confidence (a drafted token's chance is modelled as accept_rate x its
    confidence): accepted tokens over the summed confidence of the tokens each verification tested (its
    accepted ones and the first rejected one), counts decaying so that recent verifications weigh more,
    starting from `prior` (the engine's recent rate) with the weight of PRIOR_WEIGHT tested tokens."""

    __slots__ = ("index", "hits", "tested", "prior", "drafted", "accepted", "scope", "prompt_len", "confidence",
                 "misses", "idle")

    PRIOR_WEIGHT = 3.0
    DECAY = 0.9  # per verification
    MISSES_PER_DOUBLING = 8
    MAX_IDLE = 7

    def __init__(self, token_ids: list[int], scope: str, prompt_len: int, prior: float = 0.7):
        self.index = TextIndex(token_ids)
        self.hits = self.tested = 0.0
        self.prior = prior
        self.drafted = self.accepted = 0
        self.scope = scope
        self.prompt_len = prompt_len
        self.confidence: list[float] = []  # of the draft being verified
        self.misses = 0  # look-ups in a row that found nothing to propose
        self.idle = 0  # steps to skip before the next look-up

    @property
    def accept_rate(self) -> float:
        w = self.PRIOR_WEIGHT
        return min(1.0, (self.hits + w * self.prior) / (self.tested + w))

    def sync(self, token_ids: list[int]) -> None:
        if len(token_ids) > len(self.index):
            self.index.extend(token_ids[len(self.index):])

    def looked(self, found: bool) -> None:
        """A look-up found a proposal or not. Text that never repeats finds nothing step after step: after
        MISSES_PER_DOUBLING empty look-ups in a row, look every 2nd step, then every 4th, up to every
        (MAX_IDLE + 1)th; the first proposal found resets it."""
        self.misses = 0 if found else self.misses + 1
        self.idle = min((1 << (self.misses // self.MISSES_PER_DOUBLING)) - 1, self.MAX_IDLE)

    def record(self, drafted: int, accepted: int, confidence: list[float] | None = None) -> float:
        """A verification of `drafted` tokens kept `accepted`; `confidence`: the draft's (default: what
        the planner stored with it, or 1.0 per token). Returns the summed confidence of the tested tokens."""
        if not drafted:
            return 0.0
        self.drafted += drafted
        self.accepted += accepted
        conf = confidence if confidence is not None else self.confidence
        tested = min(drafted, accepted + 1)
        expected = sum(conf[:tested]) + max(0, tested - len(conf))  # confidence 1.0 where none was given
        self.hits = self.DECAY * self.hits + accepted
        self.tested = self.DECAY * self.tested + expected
        return expected
