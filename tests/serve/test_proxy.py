"""The proxy in front of vLLM, tested against a real OpenAI-compatible upstream on loopback."""

from __future__ import annotations

from fastapi.testclient import TestClient
from openai import AuthenticationError, OpenAI

from agent.scripted import ScriptedServer
from serve.proxy import create_proxy_app


def test_proxy_passes_streams_through_and_guards_with_its_key():
    turns = [{"content": "streamed through", "tool_calls": [{"name": "shell", "arguments": {"command": "ls"}}]},
             {"content": "whole", "no_stream": True}]
    with ScriptedServer(turns, model="m") as upstream:
        app = create_proxy_app(upstream.base_url.removesuffix("/v1"), api_key="outer-key")
        with TestClient(app) as http:
            client = OpenAI(base_url="http://testserver/v1", api_key="outer-key", http_client=http)
            assert [m.id for m in client.models.list()] == ["m"]
            text, calls = "", []
            for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                        tools=[{"type": "function", "function": {"name": "shell"}}],
                                                        stream=True):
                for ch in chunk.choices:
                    text += ch.delta.content or ""
                    calls += [tc.function.name for tc in ch.delta.tool_calls or [] if tc.function.name]
            assert text == "streamed through" and calls == ["shell"]
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}],
                                               tools=[{"type": "function", "function": {"name": "shell"}}])
            assert r.choices[0].message.content == "whole"
            bad = OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http)
            try:
                bad.models.list()
                raise AssertionError("the proxy let a wrong key through")
            except AuthenticationError:
                pass
        assert len(upstream.chat_requests()) == 2
