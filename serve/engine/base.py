"""The engine interface: an async stream of generated token ids for one request.

Batching, scheduling and memory are each engine's business; the API layer only renders prompts,
submits them and turns ids back into text. Closing the stream (a client that went away) cancels the
request and frees its slot.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from serve.engine.weights import WeightLoadError, WeightsLoaded


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    """With logprobs: also the N most likely tokens at each step, with their logprobs."""
    grammar: Any = None
    """A serve.structured.Constraint: each step, only tokens its grammar allows may be sampled."""
    return_routed_experts: bool = False
    """Put the MoE experts of every token the model read on the last token (engines that can)."""
    draft_scope: str = ""
    """Whose text may draft for this request (speculative decoding): requests share recent outputs only
    within one scope (the server sets it from the request's API key)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


@dataclass
class GenToken:
    id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), most likely first
    policy_version: int = 0
    """The version of the weights that produced this token (a request's tokens all share one)."""
    routed_experts: Any = None
    """On a request's last token, when asked (SamplingParams.return_routed_experts): [T, M, K] experts."""
    cached_tokens: int | None = None
    """On a request's first token, from engines with a prefix cache: how many prompt tokens it supplied."""
    drafted: int = 0
    """Speculative decoding: on the first token a verifying step gave, how many draft tokens it checked."""
    accepted: bool = False
    """Speculative decoding: this token was drafted and accepted."""


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV-cache blocks in use (0 for engines without paging)
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    policy_version: int = 0
    spec_drafted: int = 0  # speculative decoding: draft tokens verified, accepted, sequence-steps verifying
    spec_accepted: int = 0
    spec_verifies: int = 0


class Engine(ABC):
    name: str = "engine"
    max_model_len: int
    policy_version: int = 0
    """The version of the weights serving now (serve/engine/weights.py)."""
    serve_dtype: str | None = None
    """The dtype weights and activations are computed in ("bfloat16", ...; None: unknown, e.g. a proxy).
    /v1/models and every response say it, so a trainer scores a recorded request in what served it."""
    batch_invariant: bool = False
    """Whether a sequence's log-probs are a function of its token ids (serve/model/numerics.py)."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        pass

    async def stop(self) -> None:  # noqa: B027 - optional hook
        pass

    @abstractmethod
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenToken]:
        """Yield generated tokens; stop tokens are yielded too (the caller decides what to show)."""

    async def load_weights(self, path: str, policy_version: int | None = None,
                           abort_in_flight: bool = False) -> WeightsLoaded:
        """Serve the checkpoint at `path` from now on, without a restart. Requests in flight finish on
        the old weights (or, with abort_in_flight, end with RequestAborted); requests that arrive
        meanwhile wait and run on the new ones. Raises WeightLoadError, and keeps serving, when the
        checkpoint is missing, incompatible or the version does not increase."""
        raise WeightLoadError(f"engine {self.name} cannot load weights in place; use the native engine", param=None)

    def stats(self) -> EngineStats:
        return EngineStats(policy_version=self.policy_version)

    def running(self) -> bool:
        """Whether the engine can still serve requests (/health says so)."""
        return True

    def weight_bytes(self) -> int:
        return 0


class EngineStopped(RuntimeError):
    """The engine's worker has ended: requests are refused instead of waiting for ever."""

    def __init__(self) -> None:
        super().__init__("the inference engine is not running; restart composer-serve")


DONE = object()
"""Put on a request's queue by an engine thread after its last token (or after an exception)."""


async def drain(out: asyncio.Queue) -> AsyncIterator[GenToken]:
    """A request's tokens as an engine thread queues them: GenToken items until DONE; a queued
    exception is raised here, in the caller's task."""
    while True:
        item = await out.get()
        if item is DONE:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


STOP_WAIT_S = 60.0  # the longest an engine's `stop` waits for its worker thread


async def join_worker(thread: threading.Thread) -> None:
    """Wait (off the event loop, at most STOP_WAIT_S) for an engine's worker thread to end once told to: a
    process that exits right after `stop` must not tear torch down under a step still running (it aborts)."""
    if thread.is_alive() and threading.current_thread() is not thread:
        await asyncio.to_thread(thread.join, STOP_WAIT_S)
