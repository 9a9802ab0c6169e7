"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded per request.

Shared by every engine in this package so that the same request samples the same way whichever
engine serves it. The logprob returned is the model's raw log-probability of the chosen token
(before temperature, filtering and any grammar mask), as vLLM reports it by default. A sequence
with a grammar (SamplingParams.grammar) passes its matcher: its row is masked to the tokens the
grammar allows before picking, and the pick advances the matcher (serve/structured.py). Temperatures below GREEDY_BELOW
are greedy (as in vLLM): dividing by 1e-40 overflows the logits to inf, and softmax then gives NaNs.
"""

from __future__ import annotations

import torch

from serve.engine.base import SamplingParams

GREEDY_BELOW = 1e-5


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed % 2**64)  # torch takes [-2**63, 2**64); n choices use seed + i
    else:
        g.seed()
    return g


Pick = tuple[int, float | None, list[tuple[int, float]] | None]


def sample(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator, matcher=None) -> Pick:
    """Pick one token from a [V] row of logits (among those `matcher`'s grammar allows, if given); returns
    (token id, raw logprob or None, the `top_logprobs` most likely (id, logprob) pairs or None)."""
    logits_V = logits_V.float()
    allowed_V = logits_V
    if matcher is not None:
        from serve.structured import mask_rows

        allowed_V = logits_V.clone()[None]
        mask_rows(allowed_V, [matcher])
        allowed_V = allowed_V[0]
    return _sample_row(logits_V, allowed_V, params, generator, matcher)


def _sample_row(logits_V: torch.Tensor, allowed_V: torch.Tensor, params: SamplingParams,
                generator: torch.Generator, matcher) -> Pick:
    if params.temperature < GREEDY_BELOW:
        token = int(torch.argmax(allowed_V))
    else:
        scaled_V = allowed_V / params.temperature
        if params.top_k > 0 and params.top_k < scaled_V.numel():
            kth = torch.topk(scaled_V, params.top_k).values[-1]
            scaled_V = scaled_V.masked_fill(scaled_V < kth, float("-inf"))
        probs_V = torch.softmax(scaled_V, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = torch.sort(probs_V, descending=True)
            cumulative = torch.cumsum(sorted_p, dim=-1)
            drop = cumulative - sorted_p > params.top_p  # keep the smallest set reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs_V = torch.zeros_like(probs_V).scatter(0, order, sorted_p)
        token = int(torch.multinomial(probs_V, 1, generator=generator))
    if matcher is not None:
        advance(matcher, token)
    if not params.logprobs:
        return token, None, None
    logprobs_V = torch.log_softmax(logits_V, dim=-1)
    top = None
    if params.top_logprobs > 0:
        values, ids = torch.topk(logprobs_V, min(params.top_logprobs, logprobs_V.numel()))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return token, float(logprobs_V[token]), top


def sample_batch(logits_BV: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                 matchers: list | None = None) -> list[Pick | Exception]:
    """Rows sampled independently; all-greedy batches take one argmax. `matchers` (one per row, None for a
    free row) restrict each row to its grammar's tokens. A row that cannot be sampled (NaN logits, a
    grammar with nothing left to allow) gives its exception in its place: it fails its own request, not
    the batch."""
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
    if all(p.temperature < GREEDY_BELOW and not p.logprobs for p in params):
        tokens = torch.argmax(allowed_BV, dim=-1).tolist()
        return [_advanced(m, int(t)) for t, m in zip(tokens, matchers, strict=True)]
    return [_try_row(logits_BV[i], allowed_BV[i], p, g, m)
            for i, (p, g, m) in enumerate(zip(params, generators, matchers, strict=True))]


def advance(matcher, token: int) -> None:
    """Feed the sampled token to its grammar; a token the grammar refuses means the mask was not applied."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"token {token} does not follow the request's grammar")


def _advanced(matcher, token: int) -> Pick | Exception:
    try:
        if matcher is not None:
            advance(matcher, token)
        return token, None, None
    except Exception as e:  # noqa: BLE001 - that one request fails
        return e


def _try_row(logits_V, allowed_V, params, generator, matcher) -> Pick | Exception:
    try:
        return _sample_row(logits_V, allowed_V, params, generator, matcher)
    except Exception as e:  # noqa: BLE001 - returned to the caller, who fails that one request
        return e


def _try_sample(logits_V, params, generator, matcher=None) -> Pick | Exception:
    try:
        return sample(logits_V, params, generator, matcher)
    except Exception as e:  # noqa: BLE001 - returned to the caller, who fails that one request
        return e
