"""The OpenAI-compatible HTTP API: /health, /v1/models, /v1/chat/completions, /v1/completions, /metrics,
and /v1/load_weights (RL training: serve a new checkpoint in place, under a new policy version).

Every error is OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`): 400 for invalid
requests (including prompts longer than the model), 401 for a missing or wrong key when one is set,
404 for unknown models and routes, 503 for a request aborted by a weight load. Handlers for the two
completion endpoints are in serve/chat_api.py and serve/text_api.py; this module holds the app, auth,
shared request checks and errors.
"""

from __future__ import annotations

import ipaddress
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.chat_format import ChatFormat
from serve.engine.base import Engine, SamplingParams
from serve.engine.weights import RequestAborted, WeightLoadError
from serve.metrics import Metrics
from serve.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadWeightsRequest,
    validation_message,
)


@dataclass
class ServerState:
    engine: Engine
    chat: ChatFormat
    served_name: str
    max_model_len: int
    api_key: str | None = None
    model_path: str = ""
    host: str = "127.0.0.1"
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.engine.stats)

    def admin_open(self) -> bool:
        """Whether an admin call without a key is acceptable: only on a loopback-only server."""
        if self.api_key:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

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
        )


def request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def engine_error(e: Exception) -> APIError:
    """What a failed generation tells its client (in a stream: as an error event)."""
    if isinstance(e, RequestAborted):
        return APIError(503, str(e), type="server_error", code="weights_reloaded")
    return APIError(500, str(e), type="server_error")


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.engine.start()
        yield
        await state.engine.stop()

    app = FastAPI(title="composer-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state

    async def auth(request: Request) -> None:
        if state.api_key and request.headers.get("authorization") != f"Bearer {state.api_key}":
            raise APIError(401, "Incorrect or missing API key.", code="invalid_api_key")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        state.metrics.requests.labels(request.url.path, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        message, param = validation_message(list(e.errors()))
        state.metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(RequestAborted)
    async def _aborted(request: Request, e: RequestAborted):
        err = engine_error(e)
        state.metrics.requests.labels(request.url.path, str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        state.metrics.requests.labels(request.url.path, "500").inc()
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "policy_version": state.engine.policy_version}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {"id": state.served_name, "object": "model", "created": state.created, "owned_by": "composer",
                "root": state.model_path, "max_model_len": state.max_model_len,
                "policy_version": state.engine.policy_version}

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(auth)])
    async def model(name: str) -> dict[str, Any]:
        state.check_model(name)
        return model_card()

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        from serve.chat_api import chat_completion

        return await chat_completion(state, body, request)

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest, request: Request):
        from serve.text_api import text_completion

        return await text_completion(state, body, request)

    @app.post("/v1/load_weights", dependencies=[Depends(auth)])
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

    return app
