"""`composer-serve --speculative`: the flags, what a response carries (the same as without speculation:
content, tool calls under a grammar, stop strings, logprobs, streamed chunks), and where the figures show
(/metrics, the access log). The openai SDK against two servers on the same tiny random checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import openai
import pytest

from .conftest import ROOT, start_server

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 30}}, "required": ["path"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def serve_args(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "serve.cli", *args], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.parametrize("args, says", [
    (["--speculative", "eagle"], "choose from 'suffix', 'ngram', 'off'"),
    (["--speculative", "suffix", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be between 1 and 64"),
    (["--speculative", "ngram", "--speculative-cache-tokens", "-1"], "must be >= 0"),
    (["--speculative", "suffix", "--engine", "hf"], "--speculative needs the native engine"),
])
def test_bad_speculative_flags_are_usage_errors(args, says):
    out = serve_args(*args)
    assert out.returncode == 2 and says in out.stderr, out.stderr


@pytest.fixture(scope="module")
def servers(tiny_hermes):
    common = ("--served-model-name", "tiny", "--dtype", "float32", "--api-key", "sk-a", "--api-key", "sk-b")
    off = start_server(tiny_hermes, *common)
    on = start_server(tiny_hermes, *common, "--speculative", "suffix", "--num-speculative-tokens", "5")
    yield off, on
    off.stop()
    on.stop()


def ask(srv, key: str = "sk-a", **kw):
    c = openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
    return c.chat.completions.create(model="tiny", **kw)


REQUESTS = [
    dict(messages=[{"role": "user", "content": "say it again and again: the cat sat on the mat"}], max_tokens=60,
         temperature=0, logprobs=True, top_logprobs=2),
    dict(messages=[{"role": "user", "content": "read main.py"}], tools=TOOLS, tool_choice="required", max_tokens=80,
         temperature=0),
    dict(messages=[{"role": "user", "content": "json please"}], max_tokens=80, temperature=0,
         response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
    dict(messages=[{"role": "user", "content": "sample something"}], max_tokens=50, temperature=1.0, seed=9,
         logprobs=True),
    dict(messages=[{"role": "user", "content": "stop somewhere"}], max_tokens=60, temperature=0, stop=["e"]),
]


@pytest.mark.parametrize("i", range(len(REQUESTS)), ids=["logprobs", "forced-call", "json-schema", "seeded", "stop"])
def test_a_response_is_the_same_with_speculation(servers, i):
    off, on = servers
    want, got = ask(off, **REQUESTS[i]), ask(on, **REQUESTS[i])
    w, g = want.choices[0], got.choices[0]
    assert g.message.content == w.message.content
    assert g.finish_reason == w.finish_reason
    assert [(t.function.name, t.function.arguments) for t in g.message.tool_calls or []] == \
        [(t.function.name, t.function.arguments) for t in w.message.tool_calls or []]
    assert got.usage.completion_tokens == want.usage.completion_tokens
    if w.logprobs:
        assert [t.token for t in g.logprobs.content] == [t.token for t in w.logprobs.content]
        assert [t.logprob for t in g.logprobs.content] == pytest.approx([t.logprob for t in w.logprobs.content],
                                                                        abs=1e-4)


def test_streamed_chunks_are_the_same_with_speculation(servers):
    off, on = servers
    chunks = []
    for srv in (off, on):
        c = openai.OpenAI(base_url=srv.base_url, api_key="sk-b", max_retries=0)
        stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go on and on"}],
                                           max_tokens=60, temperature=0, stream=True)
        chunks.append([ch.choices[0].delta.content for ch in stream if ch.choices])
    assert chunks[0] == chunks[1]


def test_drafted_and_accepted_tokens_show_in_metrics_and_the_access_log(servers):
    _, on = servers
    for _ in range(3):  # a random model loops: its own output drafts its next tokens
        ask(on, **REQUESTS[0])
    text = httpx.get(on.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    drafted = float(re.search(r"^composer_spec_draft_tokens (\S+)$", text, re.M).group(1))
    accepted = float(re.search(r"^composer_spec_accepted_tokens (\S+)$", text, re.M).group(1))
    length = float(re.search(r"^composer_spec_mean_accepted_length (\S+)$", text, re.M).group(1))
    assert drafted > 0 and 0 < accepted <= drafted and length > 1
    assert any(re.search(r"completion_tokens=\d+ spec_drafted=\d+ spec_accepted=\d+", line) for line in on.lines)
    assert any("speculative decoding: suffix, up to 5 draft tokens" in line for line in on.lines)


def test_each_api_key_drafts_in_its_own_scope():
    """The Guard names a request's draft scope after the key it came with: two users' requests never
    share the drafter's cross-request cache (tests/serve/test_speculative.py shows scopes stay apart)."""
    import asyncio

    from serve.guard import Guard, draft_scope

    seen = []

    async def app(scope, receive, send):
        seen.append(draft_scope.get())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guarded = Guard(app, api_key=("sk-a", "sk-b"), key_paths=lambda p: p.startswith("/v1"), max_body_bytes=1000,
                    count=lambda *a: None)

    async def call(key: str) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://t") as c:
            return (await c.post("/v1/x", headers={"Authorization": f"Bearer {key}"})).status_code

    assert [asyncio.run(call(k)) for k in ("sk-a", "sk-b", "sk-a", "sk-c")] == [200, 200, 200, 401]
    assert len(seen) == 3 and seen[0] == seen[2] != seen[1] and all(seen)
    assert "sk-a" not in seen[0]  # a digest, not the key
