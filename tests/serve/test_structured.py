"""Structured output holds on a random model (issue 15, part 2): forced tool calls and response_format, through
the official openai SDK against a real composer-serve on tiny random checkpoints.

A random model never writes a tool call or JSON by itself (the controls below show it), so every valid call
and every schema-valid answer here is the grammar's doing. Schemas bound their strings (enums, maxLength) so a
random model finishes within max_tokens.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from .conftest import KEY, start_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "note": {"type": "string", "maxLength": 8},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
READ = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "enum": ["a.py", "b.py"]},
        "limit": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["path"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "read_file", "description": "Read", "parameters": READ}},
]
SCHEMAS = {"get_weather": WEATHER, "read_file": READ}
MSGS = [{"role": "user", "content": "What is the weather in Oslo for three days?"}]


@pytest.fixture(scope="module")
def client(hermes_server):
    return openai.OpenAI(base_url=hermes_server.base_url, api_key=KEY, max_retries=0)


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
def test_required_tool_choice_returns_valid_calls(client):
    """Three sampled choices in one batch, each a call of an offered tool with schema-valid arguments."""
    r = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        n=3,
        seed=7,
        temperature=1.0,
        max_tokens=150,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message.tool_calls)
    # The control: left to itself (tool_choice auto), the same random model writes no call.
    free = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, n=3, seed=7, max_tokens=60
    )
    assert all(c.message.tool_calls is None and c.finish_reason != "tool_calls" for c in free.choices)


def test_named_function_streamed(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "read_file"}},
        parallel_tool_calls=False,
        stream=True,
        seed=3,
        max_tokens=150,
    )
    calls, finish = [], None
    for chunk in stream:
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    check_calls(calls, names=("read_file",))


@pytest.mark.slow
def test_json_schema_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, response_format=fmt, n=2, seed=11, max_tokens=150
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), WEATHER)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny", messages=MSGS, response_format=fmt, stream=True, seed=12, max_tokens=150
        )
        if c.choices
    )
    jsonschema.validate(json.loads(text), WEATHER)
    # The control: without response_format the same model writes no JSON.
    free = client.chat.completions.create(model="tiny", messages=MSGS, seed=11, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_json_object(client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, response_format={"type": "json_object"}, temperature=0, max_tokens=150
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.slow
def test_constrained_and_free_sequences_share_a_batch(client, hermes_server):
    """Different grammars and none, at once: each answer follows its own (masks are per sequence)."""
    if hermes_server.engine != "native":
        pytest.skip("the hf engine serves one request at a time")
    point = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "ok": {"type": "boolean"}},
        "required": ["x", "ok"],
        "additionalProperties": False,
    }
    jobs = [
        dict(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}),
        dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": point}}),
        dict(tools=TOOLS, tool_choice="required"),
        dict(),
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        out = list(
            pool.map(
                lambda kw: client.chat.completions.create(
                    model="tiny", messages=MSGS, seed=5, max_tokens=120, **kw
                ).choices[0],
                jobs,
            )
        )
    jsonschema.validate(json.loads(out[0].message.content), WEATHER)
    jsonschema.validate(json.loads(out[1].message.content), point)
    check_calls(out[2].message.tool_calls)
    with pytest.raises(ValueError):
        json.loads(out[3].message.content)


@pytest.mark.parametrize(
    "schema,code",
    [
        ({"type": "objec"}, None),  # not a JSON Schema: refused by validation
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}, "invalid_json_schema"),
    ],
)  # valid, but no grammar can be built
def test_bad_schemas_are_400s(client, schema, code):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    err = e.value.body
    assert err["param"] == "response_format" and (code is None or err["code"] == code), err


@pytest.mark.slow
def test_qwen3_coder_format_calls(tiny_coder):
    """The XML format: the parser reads the constrained call back with typed, schema-valid arguments."""
    srv = start_server(tiny_coder, "--served-model-name", "tiny", "--dtype", "float32")
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        r = c.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", n=3, seed=2, max_tokens=150
        )
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice
            check_calls(choice.message.tool_calls)
        r = c.chat.completions.create(
            model="tiny",
            messages=MSGS,
            tools=TOOLS,
            stream=True,
            seed=4,
            max_tokens=150,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        calls = [tc for chunk in r for ch in chunk.choices for tc in ch.delta.tool_calls or []]
        check_calls(calls, names=("get_weather",))
    finally:
        srv.stop()


def test_rows_of_one_batch_follow_their_own_grammar(tiny_hermes):
    """In-process, the engine's sampling step: two grammars and a free row in one batch of logits, sampled until
    both grammars end; each constrained row yields its schema's JSON, the free row its own argmax, and logprobs
    stay the model's raw ones."""
    import torch

    from serve.chat_format import ChatFormat
    from serve.engine.base import SamplingParams
    from serve.engine.sampling import make_generator, sample_batch
    from serve.structured import Grammars

    chat = ChatFormat(tiny_hermes)
    grammars = Grammars(tiny_hermes, chat.stop_token_ids, chat.tool_format)
    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"], "additionalProperties": False}  # fmt: skip
    schemas = [WEATHER, None, point]
    params = [SamplingParams(max_tokens=99, temperature=0, logprobs=True),
              SamplingParams(max_tokens=99, temperature=0),
              SamplingParams(max_tokens=99, temperature=0.8, seed=1)]  # fmt: skip
    matchers = [grammars.json(s).matcher() if s else None for s in schemas]
    gens = [make_generator(p) for p in params]
    out: list[list[int]] = [[], [], []]
    torch.manual_seed(0)
    for _ in range(200):
        logits = torch.randn(3, 1024) * 4
        picks = sample_batch(logits, params, gens, matchers)
        assert not any(isinstance(p, Exception) for p in picks), picks
        assert picks[1][0] == int(logits[1].argmax())  # the free row is untouched
        assert picks[0][1] == pytest.approx(float(torch.log_softmax(logits[0], -1)[picks[0][0]]))
        for row, (token, _, _) in enumerate(picks):
            if row != 1 and not (out[row] and out[row][-1] in chat.stop_token_ids):
                out[row].append(token)
        if all(out[r] and out[r][-1] in chat.stop_token_ids for r in (0, 2)):
            break
    for row in (0, 2):
        assert out[row][-1] in chat.stop_token_ids, chat.decode(out[row])
        jsonschema.validate(json.loads(chat.decode(out[row][:-1])), schemas[row])


def test_grammar_masks_load_without_torchs_deprecation_chatter():
    """llguidance's torch helpers import torch's inductor, whose mkldnn module still uses
    torch.jit.script_method: 14 DeprecationWarnings in every test run that masks logits, none of them ours."""
    import subprocess
    import sys

    from .conftest import ROOT

    code = "import torch; from serve.structured import mask_rows; mask_rows(torch.zeros(1, 8), [None])"
    p = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c", code], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "script_method" not in p.stderr, p.stderr
