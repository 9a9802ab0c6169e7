"""The OpenAI-compatible HTTP API: /health, /v1/models, /v1/chat/completions, /v1/completions, /metrics,
and /v1/load_weights (RL training: serve a new checkpoint in place, under a new policy version).

Every error is OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`): 400 for invalid
requests (including prompts longer than the model), 401 for a missing or wrong key when one is set
(checked before the body is read: serve/guard.py), 404 for unknown models and routes, 413 for a body
over --max-body-mb, 503 for a request aborted by a weight load or an engine that stopped. Prompts are
rendered and tokenised on worker threads, so a huge one never stalls the event loop (and /health);
a non-streamed completion whose client disconnects is cancelled, which frees its sequences (streams
are cancelled by Starlette). Handlers for the two completion endpoints are in serve/chat_api.py and
serve/text_api.py; this module holds the app, shared request checks and errors; serve/openapi.py the
schema's error responses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.access_log import AccessLog, log_throughput
from serve.chat_format import ChatFormat, ChatFormatError
from serve.engine.base import Engine, EngineStopped, SamplingParams
from serve.engine.weights import RequestAborted, WeightLoadError
from serve.guard import Guard, route_template
from serve.metrics import Metrics
from serve.openapi import errors, install_openapi
from serve.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadWeightsRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    validation_message,
)
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
    api_key: str | None = None
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


def _tokenize(state: ServerState, body: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
    if isinstance(body, TokenizeCompletionRequest):
        text = body.prompt
    else:
        kwargs = body.chat_template_kwargs or {}
        if clash := sorted(set(kwargs) & state.chat.reserved_kwargs):
            raise APIError(400, f"chat_template_kwargs cannot set {', '.join(clash)}", param="chat_template_kwargs")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            text = state.chat.render([m.model_dump(exclude_none=True) for m in body.messages], tools,
                                     body.add_generation_prompt, **kwargs)
        except ChatFormatError as e:
            raise APIError(400, str(e), param="messages", code="chat_template_error") from None
    field = "prompt" if isinstance(body, TokenizeCompletionRequest) else "messages"
    if not body.add_special_tokens:
        return state.encode(text, field)
    state.encode(text, field)  # the length check
    return state.chat.tokenizer.encode_batch([text], add_special_tokens=True)[0].ids


def _warm_grammars(state: ServerState) -> None:
    try:
        state.grammars.tokenizer  # noqa: B018 - builds and caches it
    except Exception as e:  # noqa: BLE001 - structured output will say so per request; serving goes on
        logging.getLogger(__name__).warning("structured output unavailable: %s: %s", type(e).__name__, e)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.engine.start()
        # The grammar library's view of the vocabulary takes seconds for a real one: built now, in the
        # background, rather than on the first constrained request.
        warm = asyncio.ensure_future(state.offload(_warm_grammars, state))
        ticker = asyncio.create_task(log_throughput(state.engine.stats, state.log_interval)) \
            if state.log_interval > 0 else None
        yield
        if ticker is not None:
            ticker.cancel()
        warm.cancel()
        await state.engine.stop()
        state.workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="composer-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state

    def count(scope, status: int) -> None:
        state.metrics.requests.labels(route_template(app.routes, scope), str(status)).inc()

    app.add_middleware(Guard, api_key=state.api_key, key_paths=state.key_paths,  # type: ignore[arg-type]
                       max_body_bytes=state.max_body_bytes, count=count)
    app.add_middleware(AccessLog)  # outermost: it sees the guard's refusals too

    def error_response(request: Request, e: APIError) -> JSONResponse:
        count(request.scope, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(request, e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        message, param = validation_message(list(e.errors()))
        return error_response(request, APIError(400, message, param=param))

    @app.exception_handler(RequestAborted)
    @app.exception_handler(EngineStopped)
    async def _engine(request: Request, e: Exception):
        return error_response(request, engine_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        r = error_response(request, APIError(e.status_code, str(e.detail), type=kind))
        r.headers.update(e.headers or {})  # a 405's Allow
        return r

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        return error_response(request, APIError(500, f"internal error: {type(e).__name__}: {e}",
                                                type="server_error"))

    @app.get("/health", responses=errors(503))
    async def health():
        if not state.engine.running():  # the error body, with the status fields a health check reads
            err = engine_error(EngineStopped())
            return JSONResponse({"status": "error", "policy_version": state.engine.policy_version} | err.body(),
                                status_code=503)
        return {"status": "ok", "policy_version": state.engine.policy_version}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}},
                                                                   "description": "Prometheus metrics"}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {"id": state.served_name, "object": "model", "created": state.created, "owned_by": "composer",
                "root": state.model_path, "max_model_len": state.max_model_len,
                "policy_version": state.engine.policy_version, **state.numerics()}

    completion_responses = {200: {"content": {"application/json": {}, "text/event-stream": {}},
                                  "description": "The completion; with stream: true, server-sent events"},
                            **errors(400, 404, 500, 503)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", responses=errors(404))
    async def model(name: str) -> dict[str, Any]:
        state.check_model(name)
        return model_card()

    @app.post("/tokenize", responses=errors(400, 404))
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt's ids, or the ids a chat completion would take as its prompt."""
        if body.model is not None:
            state.check_model(body.model)
        ids = await state.offload(_tokenize, state, body)
        strs = [state.chat.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", responses=errors(400, 404))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            state.check_model(body.model)
        vocab = state.chat.tokenizer.get_vocab_size()
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens", code="invalid_token_id")
        return {"prompt": state.chat.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/chat/completions", responses=completion_responses)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        from serve.chat_api import chat_completion

        return await chat_completion(state, body, request)

    @app.post("/v1/completions", responses=completion_responses)
    async def completions(body: CompletionRequest, request: Request):
        from serve.text_api import text_completion

        return await text_completion(state, body, request)

    @app.post("/v1/load_weights", responses=errors(400, 403))
    async def load_weights(body: LoadWeightsRequest) -> dict[str, Any]:
        if not state.admin_open():
            raise APIError(403, f"loading weights is an admin action and this server listens on {state.host} "
                                "without a key: restart it with --api-key", code="api_key_required")
        try:
            r = await state.engine.load_weights(body.path, body.policy_version, body.abort_in_flight)
        except WeightLoadError as e:
            raise APIError(400, str(e), param=e.param) from None
        state.metrics.requests.labels("/v1/load_weights", "200").inc()
        return {"policy_version": r.policy_version, "load_s": round(r.load_s, 4), "wait_s": round(r.wait_s, 4),
                "aborted": r.aborted}

    install_openapi(app, state.api_key, state.key_paths, state.max_body_bytes)
    return app
