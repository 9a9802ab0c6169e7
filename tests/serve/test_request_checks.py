"""Requests that used to be JSON 500s are 400s that name the field (issue 14, item 4), and what OpenAI
accepts is accepted (item 7: a tool message without content)."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import KEY

USER = [{"role": "user", "content": "x"}]


def post(server, path, body):
    """json.dumps escapes lone surrogates as \\udXXX, as a client in another language would send them."""
    return httpx.post(server.base_url + path, content=json.dumps(body), timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


@pytest.mark.parametrize("path,body,param", [
    ("/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("/chat/completions", {"messages": USER, "seed": -(2**64)}, "seed"),
    ("/chat/completions", {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs"),
    ("/chat/completions", {"messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/chat/completions", {"messages": USER, "chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]},
     "messages"),
    ("/completions", {"prompt": "lone \udc00 surrogate"}, "prompt"),
    ("/chat/completions", {"messages": USER, "stop": ["\ud83d"]}, "stop"),
    ("/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ("/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": [1, 2]}}}]}, "tools"),
    ("/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": 5}}}]}, "tools"),
])
def test_former_500s_are_400s_with_param(native_server, path, body, param):
    r = post(native_server, path, {"model": "tiny", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_the_largest_seeds_work_for_every_choice(native_server):
    r = post(native_server, "/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 3,
                                             "seed": 2**64 - 1})  # choice i samples with seed + i
    assert r.status_code == 200, r.text


def test_a_tool_message_without_content_is_accepted(native_server):
    messages = [{"role": "user", "content": "list the files"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                      "function": {"name": "ls", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1"}]
    r = post(native_server, "/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
