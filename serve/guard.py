"""What every request passes before FastAPI sees it: the API key, then the body size.

An ASGI middleware rather than a FastAPI dependency, because a dependency runs after the body has been
read and parsed: a client without the key could make the server read and parse 50 MiB (and learn
whether its JSON was valid) before being told 401. Here the key is checked from the headers alone,
then the body is read up to `max_body_bytes` (413 beyond it, as soon as the Content-Length says so or
the bytes pass the limit) and handed on. Refusals are counted in /metrics under the route's template
(`/v1/models/{name:path}`), never the raw path, so the label set stays bounded.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.schemas import APIError


def key_ok(header: bytes | None, key: str) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case (RFC 9110), compared in constant time."""
    scheme, _, token = (header or b"").strip().partition(b" ")
    return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), key.encode())


def route_template(routes: list[BaseRoute], scope: Scope) -> str:
    """The matched route's path template, for metric labels: bounded, unlike the paths clients send."""
    route = scope.get("route")
    if route is None:
        route = next((r for r in routes if r.matches(scope)[0] is Match.FULL), None)
    return getattr(route, "path", "unmatched")


class Guard:
    def __init__(self, app: ASGIApp, *, api_key: str | None, key_paths: Callable[[str], bool], max_body_bytes: int,
                 count: Callable[[Scope, int], None]):
        self.app, self.api_key, self.key_paths = app, api_key, key_paths
        self.max_body_bytes, self.count = max_body_bytes, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.api_key and self.key_paths(scope["path"]) and not key_ok(headers.get(b"authorization"),
                                                                          self.api_key):
            await self._refuse(scope, send, APIError(401, "Incorrect or missing API key.", code="invalid_api_key"))
            return
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
