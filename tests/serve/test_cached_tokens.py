"""usage.prompt_tokens_details.cached_tokens, as OpenAI and vLLM report it: the prompt tokens the prefix cache
supplied. An agent's next turn should show its history as cached; a fresh prompt none."""

from __future__ import annotations

import secrets

import httpx
import pytest
from openai import OpenAI

KEY = "sk-test"
BLOCK = 16  # the native engine's default KV block: the cache shares whole blocks


def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=KEY)


def fresh_messages() -> list[dict]:
    # a random opening: no earlier request of the session shares even its first block
    return [{"role": "system", "content": f"session {secrets.token_hex(8)}: you are terse."},
            {"role": "user", "content": "list the files in this repository and say which one is the entry point"}]


def test_an_agents_next_turn_reports_its_history_as_cached(hermes_server):
    c = client(hermes_server)
    msgs = fresh_messages()
    first = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "now open the entry point"}]
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    second = chunks[-1].usage
    if hermes_server.engine == "hf":  # no prefix cache: nothing claimed
        assert first.usage.prompt_tokens_details is None and second.prompt_tokens_details is None
        return
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    # the first turn's prompt is a prefix of the second's: at least its whole blocks come from the cache
    assert first.usage.prompt_tokens // BLOCK * BLOCK <= cached < second.prompt_tokens
    assert cached % BLOCK == 0


def test_completions_report_cached_tokens_per_prompt(hermes_server):
    if hermes_server.engine == "hf":
        pytest.skip("the hf engine has no prefix cache (the test above checks it claims nothing)")
    url, headers = hermes_server.base_url + "/completions", {"Authorization": f"Bearer {KEY}"}
    base = [int(t) for t in secrets.token_bytes(40)]  # 40 random byte-valued ids
    body = {"model": "tiny", "prompt": base, "max_tokens": 2, "temperature": 0}
    assert httpx.post(url, json=body, headers=headers, timeout=60).json()["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0}
    # two prompts, both extending the first: each has its 2 whole blocks cached; usage sums over prompts
    body["prompt"] = [base + [7, 8, 9], base + [10] * 30]
    usage = httpx.post(url, json=body, headers=headers, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == 43 + 70 and usage["prompt_tokens_details"]["cached_tokens"] == 2 * 32
