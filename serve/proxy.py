"""A thin OpenAI-compatible front that forwards to another server (vLLM), streaming untouched.

composer-serve keeps its own address, served name and API key; the upstream runs on loopback without
one. Bodies are passed through byte for byte, SSE included, so clients see exactly what vLLM says.
"""

from __future__ import annotations

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.guard import key_ok
from serve.schemas import APIError

HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def create_proxy_app(upstream: str, api_key: str | None = None) -> FastAPI:
    """`upstream` is the other server's root, e.g. http://127.0.0.1:8123 (no /v1)."""
    app = FastAPI(title="composer-serve (proxy)", docs_url=None, redoc_url=None)
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=10.0))

    @app.post("/v1/load_weights")
    async def load_weights():  # vLLM has no in-place load of a new checkpoint behind this route
        err = APIError(501, "engine vllm cannot load weights in place; use the native engine (--engine native)",
                       type="server_error", code="not_implemented")
        return JSONResponse(err.body(), status_code=501)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request):
        if path.startswith("v1/") and api_key and not key_ok(request.headers.get("authorization", "").encode(),
                                                              api_key):
            err = APIError(401, "Incorrect or missing API key.", code="invalid_api_key")
            return JSONResponse(err.body(), status_code=401)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_HEADERS | {"host", "authorization", "accept-encoding"}}
        headers["accept-encoding"] = "identity"  # bodies are passed through as they come: never compressed
        req = client.build_request(request.method, "/" + path, params=request.query_params,
                                   content=await request.body(), headers=headers)
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            err = APIError(502, f"the upstream server is unreachable: {e}", type="server_error")
            return JSONResponse(err.body(), status_code=502)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}

        async def body():
            try:
                async for part in resp.aiter_raw():
                    yield part
            finally:
                await resp.aclose()

        if "text/event-stream" in resp.headers.get("content-type", ""):
            return StreamingResponse(body(), status_code=resp.status_code, headers=out_headers)
        data = await resp.aread()
        await resp.aclose()
        return Response(data, status_code=resp.status_code, headers=out_headers)

    return app
