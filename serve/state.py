"""What the HTTP handlers share (serve/api.py's app, serve/chat_api.py and serve/text_api.py): the server's
state, request checks that need it, request ids, the engine's errors as API errors, and cancelling a
non-streamed completion whose client went away. Its own module, so that the app and its handlers import it
and not each other.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from fastapi import Request

from serve.chat_format import ChatFormat
from serve.engine.base import Engine, EngineStopped, SamplingParams
from serve.engine.weights import RequestAborted
from serve.guard import draft_scope
from serve.metrics import Metrics
from serve.schemas import APIError, ChatCompletionRequest, CompletionRequest
from serve.structured import Grammars

T = TypeVar("T")
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
# A normaliser (NFC) can merge a few code points into one before the tokenizer sees them: the margin
# that keeps the "cannot fit" bound below a sound one.
NORMALISER_MARGIN = 4


@dataclass
class ServerState:
    engine: Engine
    chat: ChatFormat
    served_name: str
    max_model_len: int
    api_key: str | tuple[str, ...] | None = None
    """The key, or keys (one per user: requests draft speculative tokens only from their own key's)."""
    model_path: str = ""
    host: str = "127.0.0.1"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    metrics_need_key: bool = False
    log_interval: float = 10.0
    """Seconds between throughput lines while busy (serve/access_log.py); 0: none."""
    stream_interval: int = 1
    """Tokens per streamed chunk after the first (--stream-interval)."""
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics = field(init=False)
    workers: ThreadPoolExecutor = field(init=False)
    grammars: Grammars = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.engine.stats)
        self.grammars = Grammars(self.chat.dir, self.chat.stop_token_ids, self.chat.tool_format)
        # Rendering and tokenising (tokenizers releases the GIL in encode_batch: ChatFormat.encode);
        # two threads, as the engine thread wants the cores.
        self.workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="composer-prepare")

    def key_paths(self, path: str) -> bool:
        """Paths that need the key when one is set: the API, and /metrics if asked (--metrics-need-key)."""
        return path.startswith("/v1/") or path == "/v1" or (self.metrics_need_key and path == "/metrics")

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-heavy request preparation off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, partial(fn, *args))

    def encode(self, text: str, param: str) -> list[int]:
        """A prompt's token ids; refused untokenised when it certainly cannot fit: no token covers more
        than `longest_token` characters, so a longer text has more tokens than the context holds."""
        limit = self.max_model_len
        if len(text) > NORMALISER_MARGIN * self.chat.longest_token * limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                                f"{len(text)} characters, more than {limit} tokens can hold. Please reduce the "
                                "length of the input.", param=param, code="context_length_exceeded")
        return self.chat.encode(text)

    def admin_open(self) -> bool:
        """Whether an admin call without a key is acceptable: only on a loopback-only server."""
        if self.api_key:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

    def numerics(self) -> dict[str, Any]:
        """What every response carries besides policy_version: the dtype the engine computes in and whether
        its log-probs are batch-invariant (a trainer scores recorded requests the same way)."""
        return {"serve_dtype": self.engine.serve_dtype, "batch_invariant": self.engine.batch_invariant}

    def response_version(self, versions: list[int | None]) -> int:
        """The policy version of a response: its choices' (all equal: they reach the engine in consecutive
        event-loop steps, so no load command can fall between them), else, if no token came, the current."""
        return next((v for v in versions if v is not None), self.engine.policy_version)

    def check_model(self, name: str) -> None:
        if name != self.served_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def sampling(self, req: ChatCompletionRequest | CompletionRequest, prompt_len: int,
                 max_tokens: int | None, logprobs: bool, top_logprobs: int = 0) -> SamplingParams:
        limit = self.max_model_len
        field = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if prompt_len == 0:  # the engine needs a token to continue from
            raise APIError(400, f"The {field} is empty: it has no tokens to continue from.", param=field,
                           code="empty_prompt")
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                f"has {prompt_len} tokens. Please reduce the length of the input.",
                           param=field, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {field}, {max_tokens} in "
                                f"the completion). Please reduce the length of the {field} or completion.",
                           param="max_tokens", code="context_length_exceeded")
        d = self.chat.generation_defaults
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature if req.temperature is not None else d.get("temperature", 1.0),
            top_p=req.top_p if req.top_p is not None else d.get("top_p", 1.0),
            top_k=req.top_k if req.top_k is not None else d.get("top_k", -1),
            seed=req.seed, stop_token_ids=sorted(set([] if req.ignore_eos else self.chat.stop_token_ids)
                                                 | set(req.stop_token_ids or [])),
            logprobs=logprobs, top_logprobs=top_logprobs,
            return_routed_experts=getattr(req, "return_routed_experts", False),
            draft_scope=draft_scope.get(),
        )


def request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def engine_error(e: Exception) -> APIError:
    """What a failed generation tells its client (in a stream: as an error event)."""
    if isinstance(e, RequestAborted):
        return APIError(503, str(e), type="server_error", code="weights_reloaded")
    if isinstance(e, EngineStopped):
        return APIError(503, str(e), type="server_error", code="engine_stopped")
    return APIError(500, str(e), type="server_error")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await a non-streamed completion, cancelled if its client goes away first: cancelling closes its
    engine streams, which frees their sequences (else they would generate to max_tokens for no one)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op once it is done
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # its cleanup (the engine streams' close) runs now
    raise APIError(499, "the client closed the connection before the completion was done",
                   code="client_closed_request")


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: what comes next can only be that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
