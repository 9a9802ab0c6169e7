"""One choice of one request: engine tokens → text deltas (stop strings applied) → finish reason.

Both endpoints and both modes (streamed or not) consume `run_choice`, so token accounting, stop
handling and cancellation live in one place. Leaving the iteration early (a client that went away,
parallel_tool_calls=false after the first call) closes the engine's stream, which frees the slot.
Pieces and the Finish carry the policy version of the weights that made the tokens (engines stamp it
on each token), which is only known once the engine has taken the request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from serve.access_log import prompt_started, token_generated
from serve.detokenizer import Detokenizer
from serve.engine.base import Engine, SamplingParams
from serve.metrics import Metrics


@dataclass
class Piece:
    """Newly certain text and the tokens that produced it: ids, raw logprobs, top alternatives."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)
    policy_version: int | None = None
    routed_experts: Any = None  # the engine's, on the last token (SamplingParams.return_routed_experts)

    def merge(self, other: Piece) -> Piece:
        """This piece followed by `other`, as one (the later policy version and routed experts win)."""
        return Piece(self.text + other.text, self.token_ids + other.token_ids, self.logprobs + other.logprobs,
                     self.tops + other.tops, other.policy_version if other.policy_version is not None
                     else self.policy_version, other.routed_experts if other.routed_experts is not None
                     else self.routed_experts)


@dataclass
class Finish:
    reason: str  # "stop" | "length"
    completion_tokens: int
    ttft_s: float
    policy_version: int | None = None  # None when no token came
    cached_tokens: int | None = None  # prompt tokens the engine's prefix cache supplied (None: not known)


async def run_choice(engine: Engine, tokenizer, prompt_ids: list[int], params: SamplingParams,
                     stop: list[str], metrics: Metrics | None = None,
                     stream_interval: int = 1, keep_special: frozenset[int] = frozenset()
                     ) -> AsyncIterator[Piece | Finish]:
    """The choice's pieces and then its Finish. `stream_interval` > 1 gathers that many tokens into a
    piece (the first token alone, so the time to first token does not change): a streamed answer then
    sends a chunk every N tokens, which at high concurrency cuts the server's and the client's per-chunk
    work (SGLang's and vLLM's --stream-interval). `keep_special`: special tokens whose text the pieces
    keep (the parser's tags, serve/detokenizer.py); other special tokens are skipped."""
    pending: Piece | None = None
    first = True
    choice = _choice(engine, tokenizer, prompt_ids, params, stop, metrics, keep_special)
    try:
        async for item in choice:
            if isinstance(item, Finish):
                if pending is not None:
                    yield pending
                yield item
                return
            pending = item if pending is None else pending.merge(item)
            if len(pending.token_ids) >= (1 if first else stream_interval):
                first = False
                yield pending
                pending = None
    finally:  # a consumer that stops early closes the engine's stream now, not at garbage collection
        await choice.aclose()


async def _choice(engine: Engine, tokenizer, prompt_ids: list[int], params: SamplingParams,
                  stop: list[str], metrics: Metrics | None = None,
                  keep_special: frozenset[int] = frozenset()) -> AsyncIterator[Piece | Finish]:
    stop_ids = set(params.stop_token_ids)
    detok = Detokenizer(tokenizer, stop, prompt_tail=prompt_ids, keep_special=keep_special)
    start = time.monotonic()
    first: float | None = None
    n = 0
    reason = "length"
    version: int | None = None
    cached: int | None = None
    stream = engine.generate(prompt_ids, params)
    prompt_started(prompt_ids)  # the access log and throughput line (serve/access_log.py)
    try:
        async for tok in stream:
            n += 1
            token_generated(tok.drafted, tok.accepted)
            version = tok.policy_version
            if first is None:
                first = time.monotonic()
                cached = tok.cached_tokens
            if tok.id in stop_ids:
                reason = "stop"
                yield Piece("", [tok.id], [tok.logprob], [tok.top], version, tok.routed_experts)
                break
            yield Piece(detok.add(tok.id), [tok.id], [tok.logprob], [tok.top], version, tok.routed_experts)
            if detok.stopped:
                reason = "stop"
                break
        tail = detok.flush()
        if tail:
            yield Piece(tail, policy_version=version)
    finally:
        await stream.aclose()
        if metrics is not None:
            metrics.prompt_tokens.inc(len(prompt_ids))
            metrics.generated_tokens.inc(n)
            if first is not None:
                metrics.ttft.observe(first - start)
                if n > 1:
                    metrics.decode_rate.observe((n - 1) / max(1e-6, time.monotonic() - first))
    yield Finish(reason, n, (first or time.monotonic()) - start, version, cached)
