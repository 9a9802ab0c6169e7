"""A small router in front of several composer-serve (or vLLM) replicas: one address for many agents.

    composer-router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --port 8000

Routing: a request with a session goes to that session's replica while it is healthy (its prefix
cache holds the conversation so far); a new session, or a request without one, goes to the healthy
replica with the fewest requests in flight (ties: fewest sessions, then the first). The session key is the
`X-Session-Id` header, else the body's `user` field, else a hash of the conversation's first two
messages (system prompt + first user message: constant over an agent's episode, so agents that
send neither still stick). Sessions are kept in an LRU of `max_sessions`.

Failures: replicas are probed on GET /health every `health_interval` seconds; one that refuses a
connection, or drops it before answering, is marked down and the request is sent to another (it
never started generating, so retrying is safe). Once response headers have arrived the stream is
relayed as it is; a replica dying mid-stream cuts that stream (the agent retries the turn).
`POST /v1/load_weights` goes to every replica (weight sync after a training step) and succeeds only
if all of them loaded. `GET /router/status` shows replicas, their load and health.

Bodies and SSE streams are passed through byte for byte; the Authorization header goes through too,
so each replica checks its own API key. Responses carry `X-Composer-Replica` (which one answered).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "content-encoding",
    "host",
    "accept-encoding",
}


@dataclass
class Replica:
    url: str  # the server's root, e.g. http://127.0.0.1:8001 (no /v1)
    healthy: bool = True
    inflight: int = 0
    requests: int = 0
    sessions: int = 0  # sticky sessions assigned here (spreads sessions that arrive one at a time)


class Router:
    """The routing state (no I/O): sticky sessions over least-loaded healthy replicas."""

    def __init__(self, urls: list[str], max_sessions: int = 100_000):
        if not urls:
            raise ValueError("the router needs at least one replica")
        self.replicas = [Replica(u.rstrip("/").removesuffix("/v1")) for u in urls]
        self.sessions: OrderedDict[str, Replica] = OrderedDict()
        self.max_sessions = max_sessions

    def pick(self, session: str | None, exclude: frozenset[str] = frozenset()) -> Replica | None:
        if session is not None and (r := self.sessions.get(session)) is not None:
            if r.healthy and r.url not in exclude:
                self.sessions.move_to_end(session)
                return r
        live = [r for r in self.replicas if r.healthy and r.url not in exclude]
        if not live:
            return None
        r = min(live, key=lambda x: (x.inflight, x.sessions))
        if session is not None:
            if (old := self.sessions.pop(session, None)) is not None:
                old.sessions -= 1
            self.sessions[session] = r
            r.sessions += 1
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)[1].sessions -= 1
        return r


def session_key(headers, body: bytes) -> str | None:
    if sid := headers.get("x-session-id"):
        return "h:" + sid
    try:
        data = json.loads(body) if body else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("user"), str) and data["user"]:
        return "u:" + data["user"]
    msgs = data.get("messages")
    if isinstance(msgs, list) and msgs:
        return "m:" + hashlib.sha1(json.dumps(msgs[:2], sort_keys=True).encode()).hexdigest()
    return None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "server_error", "code": None}}, status_code=status
    )


def create_router_app(
    urls: list[str], *, health_interval: float = 2.0, max_sessions: int = 100_000
) -> FastAPI:
    router = Router(urls, max_sessions)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    async def probe(r: Replica) -> None:
        try:
            # Any answer below 500 is a live server (one without /health says 404); 503 = not ready.
            r.healthy = (await client.get(r.url + "/health", timeout=2.0)).status_code < 500
        except httpx.HTTPError:
            r.healthy = False

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(probe(r) for r in router.replicas))
            await asyncio.sleep(health_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(health_loop())
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="composer-router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health():
        n = sum(r.healthy for r in router.replicas)
        return JSONResponse(
            {"status": "ok" if n else "unavailable", "replicas_healthy": n}, status_code=200 if n else 503
        )

    @app.get("/router/status")
    async def status():
        return {"replicas": [r.__dict__ for r in router.replicas], "sessions": len(router.sessions)}

    @app.post("/v1/load_weights")
    async def load_weights(request: Request):
        body, headers = await request.body(), _forward_headers(request)

        async def one(r: Replica):
            try:
                resp = await client.post(r.url + "/v1/load_weights", content=body, headers=headers)
                return r.url, resp.status_code, resp.json() if resp.status_code == 200 else resp.text[:300]
            except httpx.HTTPError as e:
                return r.url, 502, str(e)

        results = await asyncio.gather(*(one(r) for r in router.replicas))
        failed = [(u, s, m) for u, s, m in results if s != 200]
        if failed:
            return _error(502, f"{len(failed)} of {len(results)} replicas did not load the weights: {failed}")
        return JSONResponse(results[0][2] | {"replicas": len(results)})

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request):
        body = await request.body()
        session = session_key(request.headers, body) if request.method == "POST" else None
        headers = _forward_headers(request)
        tried: set[str] = set()
        while (r := router.pick(session, frozenset(tried))) is not None:
            tried.add(r.url)
            req = client.build_request(
                request.method, r.url + "/" + path, params=request.query_params, content=body, headers=headers
            )
            r.inflight += 1
            try:
                resp = await client.send(req, stream=True)
            except httpx.TransportError:  # refused or dropped before any answer: safe to send elsewhere
                r.inflight -= 1
                r.healthy = False
                continue
            r.requests += 1
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
            out_headers["x-composer-replica"] = r.url
            return StreamingResponse(_relay(resp, r), status_code=resp.status_code, headers=out_headers)
        return _error(503, f"no healthy replica could take the request (tried {len(tried)})")

    return app


def _forward_headers(request: Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    headers["accept-encoding"] = "identity"  # pass bodies through exactly as they come
    return headers


async def _relay(resp: httpx.Response, r: Replica):
    try:
        async for part in resp.aiter_raw():
            yield part
    finally:
        r.inflight -= 1
        await resp.aclose()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="composer-router", description=__doc__.split("\n")[0])
    p.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's address, e.g. http://127.0.0.1:8001 (repeat for each)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health probes")
    p.add_argument("--max-sessions", type=int, default=100_000, help="sticky sessions remembered (LRU)")
    args = p.parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        raise SystemExit("composer-router needs the serve extra: pip install 'composer[serve]'") from None
    app = create_router_app(
        args.replica, health_interval=args.health_interval, max_sessions=args.max_sessions
    )
    print(
        f"composer-router at http://{args.host}:{args.port}/v1 over {len(args.replica)} replicas", flush=True
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
