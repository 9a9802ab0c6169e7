"""One bad request never stops the engine (issue 14, items 1 and 2): an empty prompt is a 400, a sequence that
fails in the engine fails alone, a tiny temperature is greedy, and an engine that stopped says so on /health."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from serve.api import ServerState, create_app
from serve.chat_format import ChatFormat
from serve.engine.base import EngineStopped, SamplingParams
from serve.engine.native import EngineConfig, NativeEngine
from serve.engine.sampling import make_generator, sample_batch

from .conftest import KEY

AUTH = {"Authorization": f"Bearer {KEY}"}


def complete(server, body, timeout=60):
    return httpx.post(server.base_url + "/completions", json={"model": "tiny", **body}, headers=AUTH, timeout=timeout)


@pytest.mark.parametrize("prompt", ["", [""], [[]], []])
def test_an_empty_prompt_is_a_400_and_the_engine_keeps_serving(native_server, prompt):
    r = complete(native_server, {"prompt": prompt, "max_tokens": 3})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and r.json()["error"]["code"] == "empty_prompt"
    r = complete(native_server, {"prompt": "def f():", "max_tokens": 3}, timeout=30)  # hung for ever before
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def stream_texts(server, body, started: threading.Event, out: list) -> None:
    """Stream a completion; append its events ("[DONE]" included) to `out`."""
    with httpx.stream("POST", server.base_url + "/completions", json={"model": "tiny", "stream": True, **body},
                      headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()


def test_a_tiny_temperature_is_greedy_and_fails_no_one(native_server):
    """temperature 1e-40 overflowed the logits to inf (NaN probabilities) and failed every stream in its batch."""
    streams, events = [], [[] for _ in range(3)]
    for out in events:
        started = threading.Event()
        t = threading.Thread(target=stream_texts, args=(native_server, {"prompt": "import os", "max_tokens": 200,
                                                                        "ignore_eos": True, "temperature": 0.9},
                                                        started, out))
        t.start()
        assert started.wait(30)
        streams.append(t)
    body = {"prompt": "def main():", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    tiny = complete(native_server, {**body, "temperature": 1e-40})
    for t in streams:
        t.join(60)
    assert tiny.status_code == 200, tiny.text
    greedy = complete(native_server, {**body, "temperature": 0})
    assert tiny.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]
    for out in events:  # the unrelated streams ran to the end
        assert out[-1] == "[DONE]" and not any("error" in e for e in out[:-1])


def test_a_row_that_cannot_be_sampled_gives_its_own_error():
    logits = torch.randn(3, 50)
    logits[1] = float("nan")
    params = [SamplingParams(max_tokens=1, temperature=0.7, seed=i) for i in range(3)]
    picks = sample_batch(logits, params, [make_generator(p) for p in params])
    assert isinstance(picks[1], RuntimeError)
    assert isinstance(picks[0], tuple) and isinstance(picks[2], tuple)


@pytest.fixture
def engine(tiny_hermes):
    e = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", max_model_len=512))
    yield e
    asyncio.run(e.stop())


def test_a_sequence_that_fails_in_the_forward_pass_fails_alone(engine):
    """A token id past the vocabulary (the API refuses those; the engine must survive them anyway) breaks the
    batch's forward pass: the batch is rerun one sequence at a time, and only the culprit fails."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0)

    async def main():
        async def run(prompt):
            return [t.id async for t in engine.generate(prompt, greedy)]

        good = asyncio.create_task(run([5, 6, 7, 8]))
        await asyncio.sleep(0.05)  # in the batch, decoding
        bad = asyncio.create_task(run([5, 6, 10**6]))
        results = await asyncio.gather(good, bad, return_exceptions=True)
        after = await asyncio.wait_for(run([9, 10]), 30)
        return results, after

    (good, bad), after = asyncio.run(main())
    assert isinstance(bad, IndexError), bad
    assert isinstance(good, list) and len(good) == 40 and len(after) == 40
    assert engine.running() and engine.blocks.usage == 0.0


def test_an_empty_prompt_is_refused_by_the_engine_itself(engine):
    async def main():
        return [t async for t in engine.generate([], SamplingParams(max_tokens=2))]

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(main())
    assert engine.running()


def test_an_engine_that_stopped_is_reported_and_refuses_requests(engine, tiny_hermes):
    """/health said ok and every request waited for ever once the engine thread had died."""
    asyncio.run(engine.stop())
    engine._thread.join(10)

    async def first_token():
        return await asyncio.wait_for(anext(engine.generate([5, 6], SamplingParams(max_tokens=2))), 5)

    with pytest.raises(EngineStopped):
        asyncio.run(first_token())
    app = create_app(ServerState(engine, ChatFormat(tiny_hermes), "tiny", 512))
    with TestClient(app) as http:
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
