"""The API's output side, in-process: an engine that replays known token ids behind the real app.

A random model cannot be made to write a tool call, so these tests use `ReplayEngine` — a real
implementation of the engine interface that emits the tokens of a given text — to check streaming
and non-streaming tool-call parsing in both formats, reasoning, stop strings, parallel_tool_calls,
finish reasons and return_token_ids, through the official openai client.
"""

from __future__ import annotations

import json
import random

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from serve.api import ServerState, create_app
from serve.chat_format import ChatFormat
from serve.detokenizer import Detokenizer
from serve.engine.base import Engine, GenToken, SamplingParams

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "limit": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "shell", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}}}}}]


class ReplayEngine(Engine):
    name = "replay"

    def __init__(self, chat: ChatFormat, max_model_len: int = 4096):
        self.chat, self.max_model_len = chat, max_model_len
        self.script: list[str] = []
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, params: SamplingParams):
        self.prompts.append(list(prompt_ids))
        text = self.script.pop(0)
        ids = self.chat.encode(text) + [params.stop_token_ids[0]]
        for i in ids[: params.max_tokens]:
            yield GenToken(i, -0.5 if params.logprobs else None)


@pytest.fixture(params=["hermes", "qwen3_coder"])
def api(request, tiny_hermes, tiny_coder):
    chat = ChatFormat(tiny_hermes if request.param == "hermes" else tiny_coder)
    engine = ReplayEngine(chat)
    app = create_app(ServerState(engine, chat, "tiny", 4096))
    with TestClient(app) as http:
        yield request.param, engine, OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http), http


def calls_text(fmt: str, calls: list[tuple[str, dict]]) -> str:
    if fmt == "hermes":
        return "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n' for n, a in calls)
    out = ""
    for n, a in calls:
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())
        out += f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>\n"
    return out


def test_tool_calls_non_streamed(api):
    fmt, engine, client, _ = api
    engine.script = ["Let me look.\n" + calls_text(fmt, [("read_file", {"path": "a.py", "limit": 5}),
                                                         ("shell", {"command": "ls -la"})])]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}], tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("read_file", {"path": "a.py", "limit": 5}), ("shell", {"command": "ls -la"})]
    assert len({c.id for c in msg.tool_calls}) == 2


def test_tool_calls_streamed_each_as_soon_as_complete(api):
    fmt, engine, client, _ = api
    engine.script = ["Sure. " + calls_text(fmt, [("read_file", {"path": "x"}), ("shell", {"command": "pwd"})])]
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                            tools=TOOLS, stream=True, stream_options={"include_usage": True})
    content, calls, finish, usage = "", [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                calls.append((tc.index, tc.function.name, json.loads(tc.function.arguments)))
            finish = ch.finish_reason or finish
    assert content.strip() == "Sure." and "<tool_call>" not in content
    assert calls == [(0, "read_file", {"path": "x"}), (1, "shell", {"command": "pwd"})]
    assert finish == "tool_calls"
    assert usage.prompt_tokens == len(engine.prompts[0]) and usage.completion_tokens > 10


def test_parallel_tool_calls_false_keeps_the_first(api):
    fmt, engine, client, _ = api
    engine.script = [calls_text(fmt, [("shell", {"command": "a"}), ("shell", {"command": "b"})])]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}], tools=TOOLS,
                                       parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["command"] for c in r.choices[0].message.tool_calls] == ["a"]


def test_malformed_call_is_plain_content_not_a_500(api):
    fmt, engine, client, _ = api
    engine.script = ["<tool_call>\n{broken json\n</tool_call>"]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}], tools=TOOLS)
    assert r.choices[0].message.tool_calls is None and "{broken json" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_tool_choice_none_and_named(api):
    fmt, engine, client, _ = api
    engine.script = [calls_text(fmt, [("shell", {"command": "a"})])]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}], tools=TOOLS,
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert b"read_file" not in json.dumps(engine.prompts[-1]).encode()  # no tools rendered
    # A named function: the call is prefilled, the model only writes the arguments.
    rest = '{"command": "pwd"}}\n</tool_call>' if fmt == "hermes" else "<parameter=command>\npwd\n</parameter>\n</function>\n</tool_call>"
    engine.script = [rest]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "shell"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "shell" and json.loads(call.function.arguments) == {"command": "pwd"}


def test_stop_strings_return_token_ids_and_logprobs(api):
    _, engine, client, http = api
    engine.script = ["alpha beta STOP gamma"]
    r = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "go"}], "stop": ["STOP"],
        "return_token_ids": True, "logprobs": True}).json()
    choice = r["choices"][0]
    assert choice["message"]["content"] == "alpha beta " and choice["finish_reason"] == "stop"
    assert r["prompt_token_ids"] == engine.prompts[-1]
    assert choice["token_ids"] and r["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == [-0.5] * len(choice["token_ids"])


def test_max_tokens_gives_finish_reason_length(api):
    _, engine, client, _ = api
    engine.script = ["one two three four five six seven eight nine ten"]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_detokenizer_is_incremental_and_exact(tiny_hermes):
    chat = ChatFormat(tiny_hermes)
    text = "naïve café → 漢字 emoji 🚀 done\n\tdef f(): return '✓'"
    ids = chat.encode(text)
    rng = random.Random(0)
    for _ in range(5):
        d = Detokenizer(chat.tokenizer, prompt_tail=[rng.randrange(100)])
        out = "".join(d.add(i) for i in ids) + d.flush()
        assert out == text and "\ufffd" not in out
    d = Detokenizer(chat.tokenizer, stop=["emoji"])
    out = "".join(d.add(i) for i in ids) + d.flush()
    assert out == "naïve café → 漢字 " and d.stopped
