"""What every request passes before FastAPI sees it: the API key, then the body size.

An ASGI middleware rather than a FastAPI dependency, because a dependency runs after the body has been
read and parsed: a client without the key could make the server read and parse 50 MiB (and learn
whether its JSON was valid) before being told 401. Here the key is checked from the headers alone,
then the body is read up to `max_body_bytes` (413 beyond it, as soon as the Content-Length says so or
the bytes pass the limit) and handed on. Refusals are counted in /metrics under the route's template
(`/v1/models/{name:path}`), never the raw path, so the label set stays bounded.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable, Sequence
from contextvars import ContextVar

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.schemas import APIError


def key_ok(header: bytes | None, key: str | Sequence[str]) -> bool:
    """`Authorization: Bearer KEY` with one of the keys, the scheme in any case (RFC 9110), compared in
    constant time."""
    return matching_key(header, key) is not None


def matching_key(header: bytes | None, key: str | Sequence[str]) -> str | None:
    scheme, _, token = (header or b"").strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    found = None
    for k in [key] if isinstance(key, str) else key:
        if secrets.compare_digest(token.strip(), k.encode()):
            found = k
    return found


draft_scope: ContextVar[str] = ContextVar("composer_draft_scope", default="")
"""Whose text a request's speculative drafts may come from: a digest of the API key it came with (each
user drafts only from their own requests), "" on a server without keys."""


def route_template(routes: list[BaseRoute], scope: Scope) -> str:
    """The matched route's path template, for metric labels: bounded, unlike the paths clients send."""
    route = scope.get("route")
    if route is None:
        route = next((r for r in routes if r.matches(scope)[0] is Match.FULL), None)
    return getattr(route, "path", "unmatched")


class Guard:
    def __init__(self, app: ASGIApp, *, api_key: str | Sequence[str] | None, key_paths: Callable[[str], bool], max_body_bytes: int,
                 count: Callable[[Scope, int], None]):
        self.app, self.api_key, self.key_paths = app, api_key, key_paths
        self.max_body_bytes, self.count = max_body_bytes, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.api_key and self.key_paths(scope["path"]):
            key = matching_key(headers.get(b"authorization"), self.api_key)
            if key is None:
                await self._refuse(scope, send, APIError(401, "Incorrect or missing API key.",
                                                         code="invalid_api_key"))
                return
            draft_scope.set(hashlib.sha256(key.encode()).hexdigest()[:16])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self._refuse(scope, send, self._too_large())
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # no one to answer
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:  # chunked, or a Content-Length that understated it
                await self._refuse(scope, send, self._too_large())
                return
        await self.app(scope, _replay(bytes(body), receive), send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} bytes "
                             "(composer-serve --max-body-mb)", code="request_too_large")

    async def _refuse(self, scope: Scope, send: Send, e: APIError) -> None:
        self.count(scope, e.status)
        body = json.dumps(e.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if e.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the buffered body once, then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
