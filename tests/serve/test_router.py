"""composer-router over two real loopback replicas: sticky sessions, least-loaded choice, a killed
replica's requests going to the other, load_weights fanned out."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from agent.scripted import ScriptedServer
from serve.router import Router, create_router_app, session_key
from tests.serve.conftest import start_server


class RouterThread:
    def __init__(self, urls: list[str], health_interval: float = 0.5):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = create_router_app(urls, health_interval=health_interval)
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RouterThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


TOOLS = [
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
]


def chat(router: RouterThread, session: str | None, text: str = "hi", **extra) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": "policy", "messages": [{"role": "user", "content": text}], "max_tokens": 4} | extra
    return httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_session_key_sources():
    assert session_key({"x-session-id": "abc"}, b'{"user": "u"}') == "h:abc"
    assert session_key({}, b'{"user": "u"}') == "u:u"
    first = b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}'
    later = (
        b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},'
        b' {"role": "assistant", "content": "a"}]}'
    )
    assert session_key({}, first) == session_key({}, later)  # an agent's episode sticks without any key
    assert session_key({}, b"not json") is None


def test_routing_policy_without_io():
    r = Router(["http://a", "http://b/v1"])
    a, b = r.replicas
    assert b.url == "http://b"
    assert r.pick("s1") is a and r.pick("s2") is b  # one at a time, sessions still spread
    a.inflight = 3
    assert r.pick("s1") is a  # sticky beats least-loaded
    assert r.pick("s3") is b and r.pick(None) is b
    b.healthy = False
    assert r.pick("s2") is a and r.pick(None, frozenset({"http://a"})) is None


def test_least_loaded_goes_to_the_idle_replica():
    slow = [{"content": "slow answer", "prefill_s": 1.5}] * 4
    with (
        ScriptedServer(slow, model="policy") as one,
        ScriptedServer(slow, model="policy") as two,
        RouterThread([one.base_url, two.base_url]) as rt,
    ):
        t = threading.Thread(target=chat, args=(rt, "busy"), kwargs={"stream": True, "tools": TOOLS})
        t.start()
        deadline = time.monotonic() + 10
        while sum(r["inflight"] for r in httpx.get(rt.url + "/router/status").json()["replicas"]) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        busy = next(
            r["url"] for r in httpx.get(rt.url + "/router/status").json()["replicas"] if r["inflight"]
        )
        idle = chat(rt, "new", tools=TOOLS)
        t.join()
        assert idle.status_code == 200 and idle.headers["x-composer-replica"] != busy
        assert len(one.chat_requests()) == len(two.chat_requests()) == 1


@pytest.mark.slow
def test_sticky_sessions_and_failover_over_composer_serve(tiny_hermes):
    reps = [
        start_server(tiny_hermes, "--served-model-name", "policy", "--dtype", "float32") for _ in range(2)
    ]
    try:
        with RouterThread([s.base_url for s in reps]) as rt:
            where = {}
            for turn in range(3):
                for sid in ("a", "b", "c", "d"):
                    r = chat(rt, sid, f"turn {turn}")
                    assert r.status_code == 200, r.text
                    assert (
                        where.setdefault(sid, r.headers["x-composer-replica"])
                        == r.headers["x-composer-replica"]
                    )
            assert len(set(where.values())) == 2  # sessions spread over both replicas
            stream = chat(rt, "a", stream=True)
            assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")

            # Weight sync through the router reaches every replica.
            r = httpx.post(
                rt.url + "/v1/load_weights", json={"path": str(tiny_hermes), "policy_version": 3}, timeout=120
            )
            assert r.status_code == 200 and r.json()["replicas"] == 2, r.text
            for s in reps:
                assert httpx.get(s.base_url + "/models").json()["data"][0]["policy_version"] == 3

            victim = where["a"]
            next(s for s in reps if s.base_url.removesuffix("/v1") == victim).proc.kill()
            time.sleep(0.3)
            for sid in ("a", "b", "c", "d"):  # sessions of the dead replica move, none fails
                r = chat(rt, sid)
                assert r.status_code == 200 and r.headers["x-composer-replica"] != victim
            status = httpx.get(rt.url + "/router/status").json()
            assert [r["healthy"] for r in status["replicas"] if r["url"] == victim] == [False]
            assert httpx.get(rt.url + "/health").status_code == 200
    finally:
        for s in reps:
            s.proc.kill()
