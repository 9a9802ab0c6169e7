"""A forced tool call always comes back as `tool_calls`, with tool schemas as agents write them: no
`additionalProperties`, integers without bounds, strings bounded only by maxLength. The official openai SDK
against composer-serve on tiny random checkpoints (a random model writes no call by itself, so every call
is the grammar's), over 20 seeds x {required, named} x {Hermes, Qwen3-Coder}."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from serve.structured import SAFE_INTEGER, tool_arguments

from .conftest import start_server

GREP = {"type": "object", "properties": {"pattern": {"type": "string", "maxLength": 40},
                                         "path": {"type": "string", "maxLength": 40}}, "required": ["pattern"]}
READ = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}, "offset": {"type": "integer"}},
        "required": ["path"]}
SCHEMAS = {"grep": GREP, "read_file": READ}
TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": s}} for n, s in SCHEMAS.items()]
MSGS = [{"role": "user", "content": "find main"}]


@pytest.mark.parametrize("fixture", ["tiny_hermes", "tiny_coder"], ids=["hermes", "qwen3_coder"])
def test_forced_calls_always_parse_with_loose_schemas(request, fixture):
    if fixture == "tiny_hermes":  # the session's server on this checkpoint with these flags (conftest.py)
        srv, own = request.getfixturevalue("plain_server"), None
    else:
        srv = own = start_server(request.getfixturevalue(fixture), "--served-model-name", "tiny", "--dtype", "float32")
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        for seed in range(20):
            for choice in ("required", {"type": "function", "function": {"name": "read_file"}}):
                parallel = seed % 4 != 0  # every fourth: parallel_tool_calls false, exactly one call
                r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice,
                                              max_tokens=400, seed=seed, temperature=1.0,
                                              parallel_tool_calls=parallel)
                done = r.choices[0]
                where = (seed, choice, done.message.content)
                assert done.finish_reason == "tool_calls" and done.message.tool_calls, where
                calls = done.message.tool_calls
                assert parallel or len(calls) == 1, where
                for call in calls:
                    assert choice == "required" or call.function.name == "read_file", where
                    args = json.loads(call.function.arguments)
                    jsonschema.validate(args, SCHEMAS[call.function.name])
                    assert set(args) <= set(SCHEMAS[call.function.name]["properties"]), where
                    assert abs(args.get("offset", 0)) <= SAFE_INTEGER, where
    finally:
        if own is not None:
            own.stop()


def test_tool_arguments_bounds_what_the_schema_leaves_open():
    s = tool_arguments({"type": "object", "properties": {
        "n": {"type": "integer"}, "k": {"type": "integer", "maximum": 5}, "x": {"type": ["number", "null"]},
        "sub": {"type": "object", "properties": {"m": {"type": "integer"}}},
        "free": {"type": "object", "additionalProperties": True}, "items": {"type": "array", "items": {"type": "integer"}}}})
    p = s["properties"]
    assert s["additionalProperties"] is False and p["sub"]["additionalProperties"] is False
    assert p["free"]["additionalProperties"] is True  # what a schema says is kept
    assert (p["n"]["minimum"], p["n"]["maximum"]) == (-SAFE_INTEGER, SAFE_INTEGER) and "minimum" not in p["k"]
    assert p["x"]["maximum"] == SAFE_INTEGER and p["sub"]["properties"]["m"]["maximum"] == SAFE_INTEGER
    assert p["items"]["items"]["maximum"] == SAFE_INTEGER
