"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded per request, in batch.

Shared by every engine in this package so that the same request samples the same way whichever engine
(and whichever of the native engine's step paths) serves it. The logprob returned is the model's raw
log-probability of the chosen token (before temperature, filtering and any grammar mask), as vLLM
reports it by default. A sequence with a grammar (SamplingParams.grammar) passes its matcher: its row is
masked to the tokens the grammar allows before picking, and the pick advances the matcher
(serve/structured.py). Temperatures below GREEDY_BELOW are greedy (as in vLLM): dividing by 1e-40
overflows the logits to inf, and softmax then gives NaNs.

How a row is drawn: `sample_rows` works on whole [B, V] tensors with per-row parameters as tensors, static
shapes and no host synchronisation, so the GPU decode step runs it inside its CUDA graph. Randomness is
counter-based, not a stateful generator: each row's Exp(1) noise E is a function of (request seed, draw
number) alone (`exponential_noise`), and the token is argmax(p / E), which picks token i with
probability p_i / sum(p) (the exponential race; vLLM samples the same way). So a seeded request gives
the same tokens alone or in any batch, eager or graph-replayed, on one kind of device (a CPU and a GPU
draw different noise).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import torch

from serve.engine.base import SamplingParams

GREEDY_BELOW = 1e-5
TOP_LOGPROBS_MAX = 20  # the API's limit; the static decode step always computes this many when asked
_M32 = 0xFFFFFFFF


@dataclass
class SeedStream:
    """A request's randomness: its seed and how many tokens it has drawn (the counter of the hash)."""

    seed: int
    draws: int = 0

    @property
    def halves(self) -> tuple[int, int]:
        return self.seed & _M32, (self.seed >> 32) & _M32


def make_generator(params: SamplingParams, device: torch.device | str | None = None) -> SeedStream:
    """The request's SeedStream: its `seed` (taken mod 2**64: the API accepts [-2**63, 2**64)), or a
    fresh random one. `device` is accepted for the engines' old call sites and unused."""
    seed = params.seed % 2**64 if params.seed is not None else secrets.randbits(64)
    return SeedStream(seed)


Pick = tuple[int, float | None, list[tuple[int, float]] | None]


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for h in [0, 2**32), in int64 without overflow (16-bit halves of c)."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32): every input bit flips about half the output bits."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def exponential_noise(seeds_B2: torch.Tensor, draws_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, V] (float32), a pure function of each row's (seed halves [B, 2], draw number [B]).

    On a GPU: a hash of (row key, column) in ~25 integer ops over [B, V], fused by nothing but cheap there
    and capturable. On a CPU those ops cost ~15 ms per 10^6 elements on 2 cores (a batch of 32 at a
    151,936-token vocabulary: ~0.5 s), so each row takes torch's exponential_ from a generator seeded with
    the row's key instead (~1 ms per row there). Either way a row's noise depends only on its own seed and
    draw, not on the batch; the two devices draw different (equally distributed) noise."""
    if seeds_B2.device.type == "cpu":
        return _exponential_noise_cpu(seeds_B2, draws_B, vocab)
    return hash_noise(seeds_B2, draws_B, vocab)


def hash_noise(seeds_B2: torch.Tensor, draws_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """The GPU's Exp(1) noise: integer hashes of (row key, column), the same on any device."""
    key_B = _mix32(seeds_B2[:, 0] ^ _mix32(seeds_B2[:, 1] ^ _mix32(draws_B & _M32)))
    col_V = torch.arange(vocab, device=seeds_B2.device, dtype=torch.int64)
    h_BV = _mix32((key_B[:, None] + col_V[None, :] * 0x61C88647) & _M32)
    u_BV = ((h_BV >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)  # in (0, 1), never 0 or 1
    return -torch.log(u_BV)


def _exponential_noise_cpu(seeds_B2: torch.Tensor, draws_B: torch.Tensor, vocab: int) -> torch.Tensor:
    # the CPU generator (mt19937) keeps only a seed's low 32 bits: the row's 32-bit key is all it gets
    keys = _mix32(seeds_B2[:, 0] ^ _mix32(seeds_B2[:, 1] ^ _mix32(draws_B & _M32))).tolist()
    out_BV = torch.empty(len(keys), vocab, dtype=torch.float32)
    gen = torch.Generator()
    for i, key in enumerate(keys):
        gen.manual_seed(key)
        out_BV[i].exponential_(generator=gen)
    return out_BV


@dataclass
class RowParams:
    """Per-row sampling parameters as tensors on the logits' device ([B] each; seeds [B, 2])."""

    temperature_B: torch.Tensor  # float32; rows below GREEDY_BELOW are greedy
    top_k_B: torch.Tensor  # int64; <= 0 or >= V: off
    top_p_B: torch.Tensor  # float32; 1: off
    seeds_B2: torch.Tensor  # int64 (low, high) 32-bit halves
    draws_B: torch.Tensor  # int64

    @staticmethod
    def of(params: list[SamplingParams], streams: list[SeedStream], device: torch.device,
           draws: list[int] | None = None) -> RowParams:
        """`draws`: each row's draw number, where not its stream's next (a verified draft's later rows)."""
        return RowParams(torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                         torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
                         torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                         torch.tensor([s.halves for s in streams], dtype=torch.int64, device=device).view(-1, 2),
                         torch.tensor(draws if draws is not None else [s.draws for s in streams], dtype=torch.int64,
                                      device=device))


def needs_filter(params: list[SamplingParams]) -> bool:
    """Whether any sampled row uses top-k or top-p (the sort over the vocabulary runs only then)."""
    return any(p.temperature >= GREEDY_BELOW and (p.top_k > 0 or p.top_p < 1.0) for p in params)


def sample_rows(logits_BV: torch.Tensor, allowed_BV: torch.Tensor, rows: RowParams, *, sampled: bool,
                filtered: bool, top_n: int, logprobs: bool = True, host: bool = False) -> tuple[torch.Tensor, ...]:
    """Pick one token per row. `logits_BV` float32 raw logits (for logprobs), `allowed_BV` the same or a
    grammar-masked copy; `sampled`: some row has temperature (else all argmax), `filtered`: some row uses
    top-k/top-p, `top_n`: how many most likely tokens to return (0: none), `logprobs`: compute the pick's
    logprob (else zeros; the static step always does, a host batch only when a row asks). Static shapes,
    no host sync. `host`: the caller samples on the host (a CPU engine's batch or verify step, not the
    static step), so a CPU tensor's argmax may go through numpy (`argmax_rows`).
    Returns (ids [B] int64, logprob of the pick [B], top ids [B, top_n], top logprobs [B, top_n],
    bad [B] bool: the row's logits hold a NaN or allow nothing, so its pick means nothing)."""
    B, V = allowed_BV.shape
    ids_B = argmax_rows(allowed_BV, host)
    if sampled:
        greedy_B = rows.temperature_B < GREEDY_BELOW
        scaled_BV = allowed_BV / torch.where(greedy_B, 1.0, rows.temperature_B)[:, None]
        if filtered:
            # top-k as the scalar path did it: everything below the k-th largest value goes
            sorted_BV, order_BV = torch.sort(scaled_BV, dim=-1, descending=True)
            k_B = torch.where((rows.top_k_B > 0) & (rows.top_k_B < V), rows.top_k_B, V)
            kth_B1 = sorted_BV.gather(1, (k_B - 1)[:, None])
            sorted_BV = sorted_BV.masked_fill(sorted_BV < kth_B1, float("-inf"))
            # top-p over what top-k left: keep the smallest prefix of the sorted probabilities reaching p
            p_BV = torch.softmax(sorted_BV, dim=-1)
            drop_BV = p_BV.cumsum(-1) - p_BV > rows.top_p_B[:, None]
            probs_BV = torch.zeros_like(p_BV).scatter(1, order_BV, p_BV.masked_fill(drop_BV, 0.0))
        else:
            probs_BV = torch.softmax(scaled_BV, dim=-1)
        drawn_B = argmax_rows(probs_BV / exponential_noise(rows.seeds_B2, rows.draws_B, V), host)
        ids_B = torch.where(greedy_B, ids_B, drawn_B)
    # a NaN anywhere in a row makes its max NaN; a row that allows nothing has -inf for its max (two
    # vectorised max reductions: torch's any/all over a row's bools ran ~7 us a 4,096-token row on a CPU)
    bad_B = torch.isnan(torch.amax(logits_BV, -1)) | (torch.amax(allowed_BV, -1) == float("-inf"))
    if not (logprobs or top_n):
        return ids_B, logits_BV.new_zeros(B), ids_B.new_empty(B, 0), logits_BV.new_empty(B, 0), bad_B
    logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    logprob_B = logprobs_BV.gather(1, ids_B[:, None])[:, 0]
    if top_n:
        top_lp_BN, top_ids_BN = torch.topk(logprobs_BV, min(top_n, V), dim=-1)
    else:
        top_lp_BN = logprobs_BV.new_empty(B, 0)
        top_ids_BN = ids_B.new_empty(B, 0)
    return ids_B, logprob_B, top_ids_BN, top_lp_BN, bad_B


def argmax_rows(x_BV: torch.Tensor, host: bool = False) -> torch.Tensor:
    """Each row's argmax [B] (the first of equal maxima; a row with a NaN gives its first NaN). On the host
    path with a CPU tensor, numpy's: torch's argmax over the last dim walks each row unvectorised (~7 us a
    4,096-token row on the 2-core VM, 34 us for a verify step's 5 rows, against numpy's 4 us), and
    verify steps sample several rows each. Same ties and NaN rule, so the same tokens."""
    if host and x_BV.device.type == "cpu" and x_BV.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.argmax(x_BV.detach().numpy(), axis=-1))
    return torch.argmax(x_BV, dim=-1)


def pack_picks(ids_B: torch.Tensor, logprob_B: torch.Tensor, top_ids_BN: torch.Tensor, top_lp_BN: torch.Tensor,
               bad_B: torch.Tensor) -> torch.Tensor:
    """`sample_rows`' results as one float32 [B, 3 + 2N] tensor (id, logprob, bad, N top ids, N top
    logprobs; ids < 2**24 are exact), so that one copy brings a batch's picks to the host."""
    return torch.cat([ids_B.float()[:, None], logprob_B.float()[:, None], bad_B.float()[:, None],
                      top_ids_BN.float(), top_lp_BN.float()], dim=1)


def picks_of(rows: list[list[float]], params: list[SamplingParams], streams: list[SeedStream],
             matchers: list | None = None) -> list[Pick | Exception]:
    """Host side of a batch's picks (`pack_picks`' rows, copied from the device): each row's Pick, or its
    exception (NaN logits, a grammar that allows nothing or refuses the pick), which fails that request
    alone. Advances every row's stream by one draw and each grammar by its pick."""
    out: list[Pick | Exception] = []
    for row, p, stream, matcher in zip(rows, params, streams, matchers or [None] * len(params), strict=True):
        stream.draws += 1
        out.append(pick_of_row(row, p, matcher))
    return out


def pick_of_row(row: list[float], p: SamplingParams, matcher=None) -> Pick | Exception:
    """One `pack_picks` row as a Pick (advancing `matcher` by it), or the exception that fails its request."""
    n = (len(row) - 3) // 2
    token = int(row[0])
    if row[2]:
        return RuntimeError("cannot sample: the logits are NaN or the grammar allows no token")
    try:
        if matcher is not None:
            advance(matcher, token)
    except Exception as e:  # noqa: BLE001 - that one request fails
        return e
    if not p.logprobs:
        return (token, None, None)
    k = min(p.top_logprobs, n)
    top = [(int(t), lp) for t, lp in zip(row[3 : 3 + k], row[3 + n : 3 + n + k], strict=True)] \
        if p.top_logprobs > 0 else None
    return (token, row[1], top)


def sample_batch(logits_BV: torch.Tensor, params: list[SamplingParams], generators: list[SeedStream],
                 matchers: list | None = None) -> list[Pick | Exception]:
    """Rows sampled independently, in one batched draw. `matchers` (one per row, None for a free row)
    restrict each row to its grammar's tokens. A row that cannot be sampled (NaN logits, a grammar with
    nothing left to allow) gives its exception in its place: it fails its own request, not the batch."""
    logits_BV = logits_BV.float()
    matchers = matchers or [None] * len(params)
    allowed_BV = logits_BV
    if any(m is not None for m in matchers):
        from serve.structured import mask_rows

        allowed_BV = logits_BV.clone()
        try:
            mask_rows(allowed_BV, matchers)
        except Exception:  # noqa: BLE001 - find the row: mask them one by one
            return [_try_sample(logits_BV[i], p, g, m) for i, (p, g, m) in enumerate(zip(params, generators, matchers,
                                                                                          strict=True))]
    sampled = any(p.temperature >= GREEDY_BELOW for p in params)
    top_n = max((p.top_logprobs for p in params if p.logprobs), default=0)
    rows = RowParams.of(params, generators, logits_BV.device) if sampled else None
    picks_BX = pack_picks(*sample_rows(logits_BV, allowed_BV, rows, sampled=sampled, filtered=needs_filter(params),
                                       top_n=top_n, logprobs=any(p.logprobs for p in params), host=True))
    return picks_of(picks_BX.tolist(), params, generators, matchers)  # one transfer to the host


def sample(logits_V: torch.Tensor, params: SamplingParams, generator: SeedStream, matcher=None) -> Pick:
    """Pick one token from a [V] row of logits (among those `matcher`'s grammar allows, if given); returns
    (token id, raw logprob or None, the `top_logprobs` most likely (id, logprob) pairs or None). Raises
    where the row cannot be sampled."""
    pick = sample_batch(logits_V[None], [params], [generator], [matcher])[0]
    if isinstance(pick, Exception):
        raise pick
    return pick


def advance(matcher, token: int) -> None:
    """Feed the sampled token to its grammar; a token the grammar refuses means the mask was not applied."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"token {token} does not follow the request's grammar")


def _try_sample(logits_V, params, generator, matcher=None) -> Pick | Exception:
    try:
        return sample(logits_V, params, generator, matcher)
    except Exception as e:  # noqa: BLE001 - returned to the caller, who fails that one request
        return e
