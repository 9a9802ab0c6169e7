"""Operability (issue 15, part 3): the access and throughput log lines, /tokenize and /detokenize as vLLM has
them, and /v1/models' `root`, against a real composer-serve whose log is read from its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from .conftest import KEY, ROOT


@pytest.fixture(scope="module")
def logged_server(tiny_hermes, tmp_path_factory):
    """composer-serve with its output in a file (the log under test), throughput lines every 0.2 s."""
    log = tmp_path_factory.mktemp("log") / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve.cli", "--model", str(tiny_hermes), "--port", "0", "--dtype", "float32",
             "--served-model-name", "tiny", "--api-key", KEY, "--log-interval", "0.2"],
            stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (m := re.search(r"serving .* at (http://\S+)/v1", log.read_text())):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    base = m.group(1)
    while httpx.get(base + "/health").status_code != 200:
        time.sleep(0.1)
    yield base, log
    proc.terminate()
    proc.wait(10)


def wait_for(log, pattern: str, timeout: float = 10) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m := re.search(pattern, log.read_text(), re.M):
            return m
        time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r} in:\n{log.read_text()[-3000:]}")


def test_access_line_per_request_and_throughput_while_busy(logged_server):
    base, log = logged_server
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=7,
                                       temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    m = wait_for(log, r"composer\.access: POST /v1/chat/completions 200 prompt_tokens=(\d+) completion_tokens=(\d+) "
                      r"ttft=([\d.]+)s duration=([\d.]+)s$")  # fmt: skip
    assert (int(m[1]), int(m[2])) == (r.usage.prompt_tokens, r.usage.completion_tokens) and int(m[2]) == 7
    assert 0 < float(m[3]) <= float(m[4])
    stream = client.completions.create(model="tiny", prompt="def f(", max_tokens=5, stream=True, n=2,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert len([c for c in stream]) > 0
    wait_for(log, r"POST /v1/completions 200 prompt_tokens=\d+ completion_tokens=10 ttft=[\d.]+s")
    httpx.get(base + "/v1/models")  # no key: the guard's 401 is logged too
    wait_for(log, r"GET /v1/models 401 prompt_tokens=0 completion_tokens=0 ttft=- duration=")
    # A line while tokens were being generated (the engine's queue and KV cache are in it too).
    wait_for(log, r"composer\.throughput: prompt [\d.]+ tokens/s, generation (?!0\.0 )[\d.]+ tokens/s, running \d+, "
                  r"waiting \d+, KV cache [\d.]+%")  # fmt: skip


def test_tokenize_and_detokenize_as_vllm(logged_server, tiny_hermes):
    base, _ = logged_server
    hf = AutoTokenizer.from_pretrained(tiny_hermes)
    r = httpx.post(
        base + "/tokenize", json={"model": "tiny", "prompt": "import os\n", "return_token_strs": True}
    )
    ids = hf("import os\n")["input_ids"]
    assert r.json() == {"count": len(ids), "max_model_len": 16384, "tokens": ids,
                        "token_strs": hf.convert_ids_to_tokens(ids)}  # fmt: skip
    msgs = [{"role": "user", "content": "Read the README"}]
    r = httpx.post(base + "/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert r["token_strs"] is None
    r = httpx.post(base + "/detokenize", json={"model": "tiny", "tokens": ids})
    assert r.json() == {"prompt": "import os\n"}
    bad = httpx.post(base + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_token_id"
    assert httpx.post(base + "/tokenize", json={"model": "gpt-9", "prompt": "x"}).status_code == 404


def test_models_give_their_root(logged_server, tiny_hermes):
    base, _ = logged_server
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.root == str(tiny_hermes)
