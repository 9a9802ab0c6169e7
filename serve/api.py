"""The OpenAI-compatible HTTP API: /health, /v1/models, /v1/chat/completions, /v1/completions, /v1/responses
(serve/responses_api.py), /metrics,
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
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.access_log import AccessLog, log_throughput
from serve.chat_format import ChatFormatError
from serve.engine.base import EngineStopped
from serve.engine.weights import RequestAborted, WeightLoadError
from serve.guard import Guard, route_template
from serve.openapi import errors, install_openapi
from serve.responses_api import ResponsesRequest
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
from serve.state import (
    ServerState as ServerState,  # the app's state: serve/state.py (handlers import it there)
)
from serve.state import engine_error


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

    @app.post("/v1/responses", responses=completion_responses)
    async def responses(body: ResponsesRequest, request: Request):
        from serve.responses_api import create_response

        return await create_response(state, body, request)

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
