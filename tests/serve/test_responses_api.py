"""POST /v1/responses with the official openai SDK (`client.responses.create`) against composer-serve on a
tiny random checkpoint: plain text, forced function calls and their outputs sent back as input items,
streamed and not, and clear 400s for what the server does not keep or know."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from serve.api import ServerState, create_app
from serve.chat_format import ChatFormat

from .test_api_parsing import ReplayEngine, calls_text

READ = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 20}}, "required": ["path"]}
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file", "parameters": READ}]


@pytest.fixture(scope="module")
def client(plain_server):
    return openai.OpenAI(base_url=plain_server.base_url, api_key="x", max_retries=0)


def test_text_answer_with_usage_and_incomplete_at_max_output_tokens(client):
    r = client.responses.create(model="tiny", input="hello", instructions="Be brief.", max_output_tokens=16)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # a random model never stops
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text and r.output_text
    assert r.usage.output_tokens == 16 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_forced_function_calls_and_their_outputs_round_trip(client):
    r = client.responses.create(model="tiny", input=[{"role": "user", "content": "read a"}], tools=TOOLS,
                                tool_choice="required", max_output_tokens=200, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    call = calls[0]
    assert call.name == "read_file" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), READ)
    named = client.responses.create(model="tiny", input="read", tools=TOOLS, max_output_tokens=200,
                                    tool_choice={"type": "function", "name": "read_file"})
    assert [o.type for o in named.output if o.type == "function_call"]
    # the call and its output sent back as input items: the next turn renders them as a tool exchange
    follow = client.responses.create(model="tiny", max_output_tokens=8, tools=TOOLS, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "read a"}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "x = 1"}])
    assert follow.status == "incomplete" and follow.output_text


def test_tools_that_are_not_functions_are_accepted_and_not_offered(client):
    """Codex CLI sends web_search and a namespace of tools with every request."""
    r = client.responses.create(model="tiny", input="read", max_output_tokens=200, tool_choice="required", tools=[
        {"type": "web_search"}, {"type": "namespace", "name": "agents", "tools": []}, *TOOLS])
    assert [o.name for o in r.output if o.type == "function_call"] and r.status == "completed"


def test_streamed_events_add_up_to_the_final_response(client):
    stream = client.responses.create(model="tiny", input="hi", max_output_tokens=12, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    calls = list(client.responses.create(model="tiny", input="read", tools=TOOLS, tool_choice="required",
                                         max_output_tokens=200, stream=True))
    kinds = [e.type for e in calls]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    done = [e.item for e in calls if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert done and all(json.loads(i.arguments) for i in done)
    # a named function, streamed: the response objects in the events carry the choice as sent (the stream
    # used to end mid-body: the pydantic choice is not JSON-serialisable)
    named = list(client.responses.create(model="tiny", input="read", tools=TOOLS, max_output_tokens=200, stream=True,
                                         tool_choice={"type": "function", "name": "read_file"}))
    assert named[-1].type == "response.completed" and named[-1].response.tool_choice.name == "read_file"


def test_streamed_text_and_parallel_calls_are_the_items_of_the_answer_not_streamed(tiny_coder):
    """Text, then calls separated by newlines (ReplayEngine replays them): one message item, as when not
    streamed; the newlines between calls used to open a message item each, under one id, repeating the text."""
    chat = ChatFormat(tiny_coder)
    engine = ReplayEngine(chat)
    calls = [("read_file", {"path": "a.py"}), ("read_file", {"path": "b.py"})]
    kw = dict(model="tiny", input="go", tools=TOOLS)
    with TestClient(create_app(ServerState(engine, chat, "tiny", 4096))) as http:
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        answers = []
        for stream in (False, True):
            engine.script = ["Reading both.\n" + calls_text("qwen3_coder", calls)]
            answers.append(list(c.responses.create(stream=True, **kw))[-1].response if stream
                           else c.responses.create(**kw))
    for r in answers:
        assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
        assert r.output_text.strip() == "Reading both."
        assert [(o.name, json.loads(o.arguments)) for o in r.output[1:]] == calls


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_x"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools"),
    ({"input": [{"type": "computer_call"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
])
def test_what_it_cannot_do_is_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**({"model": "tiny", "input": "hi", "max_output_tokens": 4} | extra))
    assert e.value.status_code == 400 and e.value.body["param"] == param
