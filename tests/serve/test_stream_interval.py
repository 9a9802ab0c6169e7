"""--stream-interval: a streamed answer in chunks of N tokens after the first, the same tokens and text as
one token a chunk, on a real composer-serve (native engine, tiny checkpoint, greedy)."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import KEY, start_server


@pytest.fixture(scope="module")
def servers(tiny_hermes):
    plain = start_server(tiny_hermes, "--served-model-name", "tiny", "--api-key", KEY, "--dtype", "float32")
    gathered = start_server(tiny_hermes, "--served-model-name", "tiny", "--api-key", KEY, "--dtype", "float32",
                            "--stream-interval", "4")
    yield plain, gathered
    plain.stop()
    gathered.stop()


def chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.base_url + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_completions_come_in_chunks_of_n_tokens_with_the_same_tokens(servers):
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 23, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "logprobs": 1}
    got = {}
    for name, server in zip(("plain", "gathered"), servers, strict=True):
        cs = [c["choices"][0] for c in chunks(server, "/completions", body) if c["choices"]]
        sizes = [len(c.get("token_ids") or []) for c in cs]
        got[name] = (sizes, [t for c in cs for t in c.get("token_ids") or []], "".join(c["text"] for c in cs),
                     [lp for c in cs if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]])
    assert got["plain"][0][:23] == [1] * 23
    sizes = [n for n in got["gathered"][0] if n]
    assert sizes == [1, 4, 4, 4, 4, 4, 2]  # the first token alone (time to first token), then 4 at a time
    assert got["gathered"][1:] == got["plain"][1:]  # same ids, text and logprobs
    assert len(got["gathered"][1]) == 23


def test_chat_streams_in_chunks_too_and_ends_the_same(servers):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 17, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    out = {}
    for name, server in zip(("plain", "gathered"), servers, strict=True):
        cs = chunks(server, "/chat/completions", body)
        deltas = [c["choices"][0]["delta"] for c in cs if c["choices"]]
        text = "".join(d.get("content") or "" for d in deltas)
        out[name] = (len(deltas), text, cs[-1]["usage"]["completion_tokens"],
                     [c["choices"][0]["finish_reason"] for c in cs if c["choices"] and c["choices"][0]["finish_reason"]])
    assert out["gathered"][1:] == out["plain"][1:]
    assert out["gathered"][0] < out["plain"][0]  # fewer chunks for the same answer


def test_a_bad_interval_is_refused(tiny_hermes):
    with pytest.raises(RuntimeError, match="--stream-interval must be >= 1"):
        start_server(tiny_hermes, "--stream-interval", "0", timeout=60)
