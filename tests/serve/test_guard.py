"""Limits and the key (issue 14, items 5 and 6): a body over the limit is a 413 unread, a prompt that cannot
fit is refused untokenised, tokenising never stalls the event loop, the key is checked before the body,
`bearer` in any case, metric labels are route templates, and /metrics can need the key."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import uuid
from urllib.parse import urlparse

import httpx

from .conftest import KEY, start_server

AUTH = {"Authorization": f"Bearer {KEY}"}


def root(server) -> str:
    return server.base_url.removesuffix("/v1")


def send_head(server, path: str, length: int, headers: str = "", timeout: float = 5) -> str:
    """Announce a body of `length` bytes, send 1 KiB of it, and return the status line of the answer
    (a server that waits for the rest never answers: socket.timeout)."""
    url = urlparse(server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n{headers}\r\n".encode() + b"{" + b" " * 1023)
        return s.recv(4096).decode().split("\r\n")[0]


def test_a_body_over_the_limit_is_a_413_unread(native_server):
    assert send_head(native_server, "/v1/chat/completions", 50 * 2**20, f"Authorization: Bearer {KEY}\r\n") \
        == "HTTP/1.1 413 Request Entity Too Large"

    def chunks():  # no Content-Length: the limit is counted as the bytes come
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(17):
            yield b"x" * 2**20
        yield b'"}'

    r = httpx.post(native_server.base_url + "/completions", content=chunks(), headers=AUTH, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_prompt_that_cannot_fit_is_refused_before_tokenising(native_server):
    start = time.monotonic()
    r = httpx.post(native_server.base_url + "/completions", headers=AUTH, timeout=60,
                   json={"model": "tiny", "prompt": "word " * 1_600_000, "max_tokens": 1})  # 8 MB: ~14 s to tokenise
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - start < 4


def test_tokenising_leaves_the_event_loop_free(native_server):
    rng = random.Random(0)
    words = " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randrange(3, 12)))
                     for _ in range(250_000))  # 2 MB, under the cannot-fit bound: tokenised, seconds of work
    done = threading.Event()
    result = []

    def big():
        result.append(httpx.post(native_server.base_url + "/completions", headers=AUTH, timeout=60,
                                 json={"model": "tiny", "prompt": words, "max_tokens": 1}))
        done.set()

    threading.Thread(target=big).start()
    time.sleep(0.3)  # parsed, now tokenising
    waits = []
    while not done.is_set():
        start = time.monotonic()
        assert httpx.get(root(native_server) + "/health", timeout=30).status_code == 200
        waits.append(time.monotonic() - start)
    assert result[0].status_code == 400 and result[0].json()["error"]["code"] == "context_length_exceeded"
    assert len(waits) > 3 and max(waits) < 1.0, waits


def test_the_key_is_checked_before_the_body(native_server):
    assert send_head(native_server, "/v1/chat/completions", 50 * 2**20) == "HTTP/1.1 401 Unauthorized"
    r = httpx.post(native_server.base_url + "/chat/completions", content=b"{not json",
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_bearer_in_any_case(native_server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(native_server.base_url + "/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, scheme
    assert httpx.get(native_server.base_url + "/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401


def test_metric_labels_are_route_templates(native_server):
    names = [uuid.uuid4().hex for _ in range(20)]
    for i, name in enumerate(names):
        headers = AUTH if i % 2 else {}  # 404s and 401s
        httpx.get(f"{native_server.base_url}/models/{name}", headers=headers)
        httpx.get(f"{root(native_server)}/nothing/{name}")
    metrics = httpx.get(root(native_server) + "/metrics").text
    assert not any(name in metrics for name in names)
    assert 'endpoint="/v1/models/{name:path}",status="404"' in metrics
    assert 'endpoint="/v1/models/{name:path}",status="401"' in metrics
    assert 'endpoint="unmatched",status="404"' in metrics


def test_metrics_can_need_the_key(tiny_hermes):
    srv = start_server(tiny_hermes, "--served-model-name", "tiny", "--api-key", KEY, "--metrics-need-key",
                       "--max-body-mb", "0.5")
    try:
        assert httpx.get(root(srv) + "/metrics").status_code == 401
        assert "composer_requests_total" in httpx.get(root(srv) + "/metrics", headers=AUTH).text
        assert httpx.get(root(srv) + "/health").json()["status"] == "ok"
        assert "paths" in httpx.get(root(srv) + "/openapi.json").json()
        body = json.dumps({"model": "tiny", "prompt": "x" * 600_000})
        r = httpx.post(srv.base_url + "/completions", content=body, headers=AUTH | {"Content-Type": "application/json"})
        assert r.status_code == 413 and "524288 bytes" in r.json()["error"]["message"]
    finally:
        srv.stop()
