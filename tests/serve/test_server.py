"""composer-serve as a subprocess on a tiny random checkpoint, driven by the openai client and raw HTTP."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from serve.engine.vllm import VLLMUnavailable, vllm_command

from .conftest import ROOT

KEY = "sk-test"
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "description": "Path."}}, "required": ["path"]}}}]


@pytest.fixture(scope="module")
def client(hermes_server):
    return OpenAI(base_url=hermes_server.base_url, api_key=KEY)


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60, **kw)


def test_models_and_health(hermes_server, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    health = httpx.get(hermes_server.base_url.removesuffix("/v1") + "/health").json()
    assert health == {"status": "ok", "policy_version": 0}


def test_chat_usage_counts_match_apply_chat_template(client, tiny_hermes):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read the README please."}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=5, temperature=0)
    hf = AutoTokenizer.from_pretrained(tiny_hermes)
    ids = hf.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("choice,opening", [
    ("required", '<tool_call>\n{"name": "'),
    ({"type": "function", "function": {"name": "read_file"}}, '<tool_call>\n{"name": "read_file", "arguments": '),
])
def test_forced_tool_choice_continues_from_an_opened_call(hermes_server, tiny_hermes, choice, opening):
    """The model's answer is generated after the opening of a call: the prompt is the template's plus it."""
    msgs = [{"role": "user", "content": "Read the README please."}]
    r = post(hermes_server, "/chat/completions", {"model": "tiny", "messages": msgs, "tools": TOOLS,
                                                   "tool_choice": choice, "max_completion_tokens": 4,
                                                   "temperature": 0, "top_p": 0.5, "return_token_ids": True})
    assert r.status_code == 200, r.text
    hf = AutoTokenizer.from_pretrained(tiny_hermes)
    text = hf.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    body = r.json()
    assert body["prompt_token_ids"] == hf(text + opening, add_special_tokens=False)["input_ids"]
    assert body["usage"]["completion_tokens"] == 4  # max_completion_tokens is honoured


def test_logprobs_with_top_alternatives_streamed_and_not(client, hermes_server):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "count to three"}], max_tokens=10, temperature=0,
              logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for e in content:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    streamed = [e for c in client.chat.completions.create(**kw, stream=True) for ch in c.choices
                if ch.logprobs and ch.logprobs.content for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    r = post(hermes_server, "/chat/completions", {**kw, "logprobs": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_completions_logprobs_in_the_legacy_format(client):
    r = client.completions.create(model="tiny", prompt="import os\n", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == r.usage.completion_tokens == 6
    for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(v)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    streamed = [t for c in client.completions.create(model="tiny", prompt="import os\n", max_tokens=6,
                                                     temperature=0, logprobs=2, stream=True)
                for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert streamed == lp.tokens


def test_greedy_output_equals_transformers_generate(hermes_server, tiny_hermes):
    msgs = [{"role": "user", "content": "def fibonacci(n):"}]
    r = post(hermes_server, "/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 24,
                                                   "temperature": 0, "return_token_ids": True}).json()
    hf = AutoTokenizer.from_pretrained(tiny_hermes)
    prompt = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert r["prompt_token_ids"] == list(prompt)
    model = AutoModelForCausalLM.from_pretrained(tiny_hermes, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                         eos_token_id=hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    expected = out[0, len(prompt):].tolist()
    assert r["choices"][0]["token_ids"] == expected
    assert r["choices"][0]["message"]["content"] == hf.decode(
        [t for t in expected if t not in hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])],
        skip_special_tokens=True)


def test_streaming_with_usage_equals_non_streaming(client):
    msgs = [{"role": "user", "content": "count to three"}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    text, usage, chunks = "", None, 0
    for chunk in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        chunks += 1
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
    assert text == whole.choices[0].message.content and chunks > 3
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens


def test_seeded_sampling_is_reproducible_and_n_choices(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=1.0, seed=7)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = client.chat.completions.create(**kw, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].message.content == a.choices[0].message.content


def test_completions_endpoint(client, hermes_server):
    r = client.completions.create(model="tiny", prompt="import os\n", max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="import os\n", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    ids = post(hermes_server, "/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2,
                                               "return_token_ids": True}).json()
    assert ids["prompt_token_ids"] == [[5, 6, 7]] and len(ids["choices"][0]["token_ids"]) == 2


@pytest.mark.parametrize("body,param,needle", [
    ({"model": "tiny"}, "messages", "messages is required"),
    ({"model": "tiny", "messages": []}, "messages", "at least 1"),
    ({"model": "tiny", "messages": "hello"}, "messages", "valid list"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature", "number"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x " * 20000}]}, "messages", "maximum context length"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000000}, "max_tokens",
     "maximum context length"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice",
     "needs at least one tool"),
])
def test_bad_requests_are_openai_400s(hermes_server, body, param, needle):
    r = post(hermes_server, "/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and needle in err["message"]


def test_a_too_long_completions_prompt_is_a_400_on_prompt(hermes_server):
    r = post(hermes_server, "/completions", {"model": "tiny", "prompt": "x " * 20000, "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert "maximum context length" in err["message"]


def test_malformed_json_unknown_model_and_auth(hermes_server):
    r = httpx.post(hermes_server.base_url + "/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(hermes_server.base_url + "/chat/completions", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request has no JSON body"
    r = httpx.post(hermes_server.base_url + "/chat/completions", headers=headers, json=["a", "list"])
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object"
    r = post(hermes_server, "/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for key in (None, "wrong"):
        r = post(hermes_server, "/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                 key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=hermes_server.base_url, api_key="wrong").models.list()


def test_a_client_that_disconnects_frees_its_slot(hermes_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 3000,
            "temperature": 0.9, "stream": True}
    with httpx.stream("POST", hermes_server.base_url + "/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    # The hf engine serves one request at a time: if the abandoned one still held the slot, this would wait
    # for its 3000 tokens.
    start = time.monotonic()
    r = post(hermes_server, "/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 4})
    assert r.status_code == 200 and time.monotonic() - start < 10
    metrics = httpx.get(hermes_server.base_url.removesuffix("/v1") + "/metrics").text
    assert "composer_requests_running 0.0" in metrics and "composer_requests_waiting 0.0" in metrics
    assert "composer_time_to_first_token_seconds_count" in metrics and "composer_generation_tokens_total" in metrics


def test_composer_agent_runs_against_composer_serve(hermes_server, tmp_path):
    (tmp_path / ".composer").mkdir()
    (tmp_path / ".composer" / "config.toml").write_text("max_output_tokens = 48\ntemperature = 0.0\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "COMPOSER_API_KEY": KEY}
    p = subprocess.run([sys.executable, "-m", "agent.cli", "--cwd", str(tmp_path), "--task", "say hi", "--json",
                        "--base-url", hermes_server.base_url, "--model", "tiny", "--max-turns", "2"],
                       capture_output=True, text=True, timeout=300, env=env)
    events = [json.loads(line) for line in p.stdout.splitlines()]
    assert p.returncode in (0, 1), p.stderr
    assert events[0]["type"] == "session_started" and events[0]["context_window"] == 16384
    assert events[-1]["type"] == "finished" and events[-1]["status"] in ("completed", "max_turns", "max_tokens")
    assert any(e["type"] == "usage" and not e["estimated"] for e in events)


def test_vllm_command_construction():
    cmd = vllm_command("/m/Qwen3-Coder", host="127.0.0.1", port=9001, served_name="coder", tool_format="qwen3_coder",
                       reasoning=False, quant="mxfp8", max_model_len=65536, capability=(9, 0))
    assert cmd[:3] == ["vllm", "serve", "/m/Qwen3-Coder"]
    assert " ".join(cmd).endswith("--enable-auto-tool-choice --tool-call-parser qwen3_coder --max-model-len 65536 "
                                  "--quantization fp8")
    assert "--served-model-name coder" in " ".join(cmd) and "--port 9001" in " ".join(cmd)
    b = vllm_command("m", host="h", port=1, served_name="m", tool_format="hermes", reasoning=True, quant="mxfp8",
                     capability=(10, 0), dtype="bfloat16")
    assert "--quantization mxfp8" in " ".join(b) and "--reasoning-parser qwen3" in " ".join(b)
    assert "--dtype bfloat16" in " ".join(b) and "--tool-call-parser hermes" in " ".join(b)
    assert "--quantization" not in vllm_command("m", host="h", port=1, served_name="m", tool_format="hermes",
                                                reasoning=False)
    with pytest.raises(VLLMUnavailable):
        vllm_command("m", host="h", port=1, served_name="m", tool_format="hermes", reasoning=False, quant="mxfp8")
    # speculative decoding passes on as vLLM's own drafters of the same names
    spec = vllm_command("m", host="h", port=1, served_name="m", tool_format="hermes", reasoning=False,
                        speculative="ngram", num_speculative_tokens=5)
    i = spec.index("--speculative-config")
    assert json.loads(spec[i + 1]) == {"method": "ngram", "num_speculative_tokens": 5}
    assert "--speculative-config" not in vllm_command("m", host="h", port=1, served_name="m", tool_format="hermes",
                                                      reasoning=False)


FAKE_VLLM = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a worker, like vLLM's
open(sys.argv[2], "w").write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_launched_vllm_is_waited_for_and_stopped_with_its_workers(tmp_path):
    """A stand-in server process (it answers /health and has a worker child) goes through launch and stop."""
    import socket

    from serve.engine.vllm import launch, stop

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script, pid_file = tmp_path / "fake_vllm.py", tmp_path / "worker.pid"
    script.write_text(FAKE_VLLM)
    proc = launch([sys.executable, str(script), str(port), str(pid_file)], f"http://127.0.0.1:{port}", timeout_s=30)
    worker = int(pid_file.read_text())
    assert proc.poll() is None and httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    stop(proc, grace_s=5)
    assert proc.poll() is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.05)
    assert not _alive(worker)  # the whole process group went, not just the server


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"  # a zombie waiting for init counts as gone
    except OSError:
        return False


def test_engine_vllm_without_vllm_is_a_one_line_error(tiny_hermes):
    p = subprocess.run([sys.executable, "-m", "serve.cli", "--model", str(tiny_hermes), "--engine", "vllm", "--port",
                        "0"], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        "composer-serve: error: vllm is not installed; on a GPU machine: pip install 'composer[vllm]'")


def test_a_checkpoint_without_a_readable_tokenizer_is_a_one_line_error(tiny_hermes, tmp_path):
    """tokenizers raises a bare Exception for a missing file, which used to end in a traceback."""
    model = tmp_path / "model"
    shutil.copytree(tiny_hermes, model)
    (model / "tokenizer.json").unlink()
    cmd = [sys.executable, "-m", "serve.cli", "--model", str(model), "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"composer-serve: error: {model} has no tokenizer.json " \
                                                "(a Hugging Face fast tokenizer is needed)"
    (model / "tokenizer.json").write_text("{not json")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"composer-serve: error: cannot read {model}/tokenizer.json")
