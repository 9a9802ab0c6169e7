"""A client that goes away frees its sequences, on every endpoint, streamed or not (issue 14, item 3).

Non-streamed /v1/completions used to generate to max_tokens for no one (16 gone clients held 97% of the
KV cache for minutes). Real clients here disconnect for real: a read timeout closes the connection."""

from __future__ import annotations

import threading

import httpx
import pytest

from .conftest import KEY, gauge, wait_idle

LONG = {"max_tokens": 8000, "ignore_eos": True, "temperature": 0.8}
BODIES = {"completions": {"model": "tiny", "prompt": "import os\n", **LONG},
          "chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], **LONG}}


def abandon(server, path: str, stream: bool, n: int = 1) -> None:
    """Send the request, wait for it to be generating, then close the connection."""
    body = BODIES[path] | {"stream": stream, "n": n}
    headers = {"Authorization": f"Bearer {KEY}"}
    if stream:
        with httpx.stream("POST", f"{server.base_url}/{path}", json=body, headers=headers, timeout=30) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 4:
                    return
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/{path}", json=body, headers=headers, timeout=httpx.Timeout(30, read=1.5))


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_abandoned_requests_free_their_sequences(native_server, path, stream):
    assert wait_idle(native_server)
    clients = [threading.Thread(target=abandon, args=(native_server, path, stream, n)) for n in (1, 1, 2, 3)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(60)
    # 8000 tokens each would take a minute or more on this model: idle within seconds means they were cancelled
    assert wait_idle(native_server, timeout=10), (gauge(native_server, "composer_requests_running"),
                                                  gauge(native_server, "composer_kv_cache_usage_ratio"))
