"""--record-tokens: the session holds exactly the token ids the server tokenised and sampled.

End to end against a real composer-serve on a tiny random checkpoint (its answers are gibberish; only
the bookkeeping matters), against the scripted server (no token ids: a clear configuration error), and
the client's accumulation in-process over mocked HTTP (whole responses, mismatches, interruptions).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from agent.client import ModelError, OpenAIClient, StreamCallbacks
from agent.config import Config, ConfigError
from agent.scripted import ScriptedServer
from agent.session import find_session, load
from serve.chat_format import ChatFormat
from serve.tiny import build_tiny_checkpoint
from tests.serve.conftest import start_server

from .test_headless import run_agent

TOKEN_KEYS = {"prompt_token_ids", "completion_token_ids", "completion_logprobs", "policy_version"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-hermes", template="hermes")


@pytest.fixture(scope="module")
def server(ckpt):
    srv = start_server(ckpt, "--served-model-name", "tiny", "--dtype", "float32")
    yield srv
    srv.stop()


def configure(repo: Path, **settings) -> None:
    """A repo config with short greedy answers (fast and the same every run), plus `settings`."""
    settings = {"max_output_tokens": 24, "temperature": 0.0, **settings}
    (repo / ".composer").mkdir(exist_ok=True)
    (repo / ".composer" / "config.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))


def session_of(repo: Path):
    return load(find_session(repo / ".composer" / "sessions", "last"))


def answer_of(data, rec: dict) -> str:
    """What the agent kept of a request's answer: the next record is its message (or the summary)."""
    nxt = data.records[data.records.index(rec) + 1]
    return nxt["message"]["content"] if rec["purpose"] == "turn" else nxt["summary"]


def check_token_records(data, ckpt: Path) -> list[dict]:
    chat = ChatFormat(ckpt)
    requests = list(data.requests())
    assert requests
    answers = []
    previous: list[int] = []
    for rec, sent in requests:
        prompt, ids, logprobs = rec["prompt_token_ids"], rec["completion_token_ids"], rec["completion_logprobs"]
        # the server's prefix cache (whole 16-token blocks): a request that extends the previous one reuses it
        cached = rec["usage"]["cached_tokens"]
        assert cached % 16 == 0 and 0 <= cached < len(prompt)
        if previous and prompt[: len(previous)] == previous:
            assert cached >= len(previous) // 16 * 16
        previous = prompt
        assert prompt and all(type(i) is int for i in prompt)
        assert all(type(i) is int for i in ids)
        assert len(ids) == len(logprobs) == rec["usage"]["completion_tokens"] > 0
        assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs)
        assert rec["policy_version"] is None or type(rec["policy_version"]) is int
        assert rec["usage"]["prompt_tokens"] == len(prompt) and not rec["usage"]["estimated"]
        # The ids are the chat format's rendering of what the session says was sent: a trainer can
        # rebuild the prompt from the messages, and the ids prove it matches the server's.
        tools = data.meta["tools"] if rec["purpose"] == "turn" else None
        assert prompt == chat.render_ids(sent, tools)
        # composer-serve's experts for every token read that the previous request did not already give
        routes = rec["routed_experts"]
        assert routes["start"] + routes["shape"][0] == len(prompt) + len(ids) - 1 and routes["shape"][1:] == [2, 2]
        answer = answer_of(data, rec)
        assert answer.strip() in chat.decode(ids)
        answers.append(answer)
    assert any(a.strip() for a in answers)  # else "contained in the decoded ids" proved nothing
    return [rec for rec, _ in requests]


def test_the_flag_records_the_sampled_tokens(git_repo, server, ckpt):
    configure(git_repo)
    p = run_agent(git_repo, "--task", "say hi", "--json", "--base-url", server.base_url, "--record-tokens",
                  "--max-turns", "2", timeout=240)
    assert p.returncode in (0, 1), p.stderr  # gibberish may call a tool and hit max_turns; never an error
    assert "error" not in p.stderr
    finished = json.loads(p.stdout.splitlines()[-1])
    assert finished["type"] == "finished" and finished["status"] in ("completed", "max_turns", "max_tokens")  # a random model runs into max_output_tokens
    records = check_token_records(session_of(git_repo), ckpt)
    assert {r["purpose"] for r in records} == {"turn"} and len(records) == finished["turns"]


def test_the_config_file_turns_it_on_for_summaries_too(git_repo, server, ckpt):
    # A window this small makes the agent summarise before its first turn: both purposes are recorded.
    configure(git_repo, base_url=server.base_url, record_tokens=True, context_window=1024, max_turns=1)
    p = run_agent(git_repo, "--task", "say hi", timeout=240)
    assert p.returncode in (0, 1), p.stderr
    assert "error" not in p.stderr
    records = check_token_records(session_of(git_repo), ckpt)
    assert [r["purpose"] for r in records] == ["summary", "turn"]


def test_a_server_without_token_ids_is_a_configuration_error(git_repo):
    with ScriptedServer([{"content": "never recorded"}]) as srv:
        p = run_agent(git_repo, "--task", "x", "--base-url", srv.base_url, "--record-tokens")
        body = srv.chat_requests()[0]
    assert p.returncode == 2, p.stderr
    assert ("--record-tokens needs a server that returns token ids (composer-serve, or vLLM >= 0.10.2 with "
            f"return_token_ids); {srv.base_url} returned none") in p.stderr
    assert body["return_token_ids"] is True and body["logprobs"] is True and body["stream"] is True
    assert body["return_routed_experts"] is True


def test_off_by_default_nothing_is_asked_or_recorded(git_repo):
    with ScriptedServer([{"content": "plain"}]) as srv:
        p = run_agent(git_repo, "--task", "x", "--base-url", srv.base_url)
        bodies = srv.chat_requests()
    assert p.returncode == 0 and p.stdout.strip() == "plain", p.stderr
    assert bodies and not any({"return_token_ids", "logprobs", "return_routed_experts"} & set(b) for b in bodies)
    requests = [r for r in session_of(git_repo).records if r["type"] == "request"]
    assert requests and not any(TOKEN_KEYS & set(r) for r in requests)


def test_record_tokens_must_be_a_boolean():
    with pytest.raises(ConfigError, match="record_tokens"):
        Config(record_tokens="true")


# -- the client over mocked HTTP ------------------------------------------------------------------------


def mocked_client(answer, **config) -> tuple[OpenAIClient, list[dict]]:
    """A client whose server is `answer(body) -> httpx.Response`; returns it and the bodies it got."""
    client = OpenAIClient(Config(model="m", record_tokens=True, max_retries=0, **config))
    bodies: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return answer(bodies[-1])

    client.http = httpx.Client(transport=httpx.MockTransport(handle))
    return client, bodies


def sse(*chunks: dict) -> httpx.Response:
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=text)


def lp(*values: float) -> dict:
    return {"content": [{"token": "t", "logprob": v, "bytes": []} for v in values]}


def delta(text: str, ids: list[int], logprobs: dict | None, version: int | None = 7, **extra) -> dict:
    choice = {"index": 0, "delta": {"content": text}, "token_ids": ids, "logprobs": logprobs, "finish_reason": None}
    return {"choices": [choice], **({"policy_version": version} if version is not None else {}), **extra}


def complete(client: OpenAIClient, cb: StreamCallbacks | None = None, cancel: threading.Event | None = None):
    return client.complete([{"role": "user", "content": "hi"}], None, cb or StreamCallbacks(),
                           cancel or threading.Event())


def test_streamed_token_ids_and_the_oldest_policy_version():
    client, bodies = mocked_client(lambda body: sse(
        delta("", [], None, prompt_token_ids=[1, 2, 3]),
        delta("Hel", [10, 11], lp(-0.5, -0.25)),
        delta("lo", [12], lp(-1.0), version=6),  # weights changed mid-stream: the older version counts
        {"choices": [{"index": 0, "delta": {}, "token_ids": [2], "logprobs": lp(-0.125), "finish_reason": "stop"}],
         "policy_version": 8},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}))
    turn = complete(client)
    assert turn.content == "Hello"
    t = turn.tokens
    assert (t.prompt_token_ids, t.completion_token_ids) == ([1, 2, 3], [10, 11, 12, 2])
    assert t.completion_logprobs == [-0.5, -0.25, -1.0, -0.125] and t.policy_version == 6
    assert bodies[0]["return_token_ids"] is True and bodies[0]["logprobs"] is True and bodies[0]["stream"]


def test_a_whole_response_is_recorded_too():
    whole = {"prompt_token_ids": [5, 6], "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                                       "token_ids": [40, 2], "logprobs": lp(-0.1, -0.2),
                                                       "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 2, "completion_tokens": 2}}
    client, _ = mocked_client(lambda body: httpx.Response(200, json=whole))
    turn = complete(client)
    assert turn.content == "ok" and turn.tokens.prompt_token_ids == [5, 6]
    assert turn.tokens.completion_token_ids == [40, 2] and turn.tokens.completion_logprobs == [-0.1, -0.2]
    assert turn.tokens.policy_version is None


@pytest.mark.parametrize("chunks, kind, says", [
    ([delta("a", [10, 11], lp(-0.5), prompt_token_ids=[1])], "request", "returned 1 logprobs for 2 completion"),
    ([delta("a", [10], None, prompt_token_ids=[1])], "request", "returned 0 logprobs for 1 completion"),
    ([{"choices": [{"index": 0, "delta": {"content": "a"}}], "prompt_token_ids": [1]}], "config",
     "returned no completion token_ids"),
    ([delta("a", [10], lp(-0.5))], "config", "returned no prompt_token_ids"),
])
def test_answers_that_cannot_be_trained_on_fail_clearly(chunks, kind, says):
    client, _ = mocked_client(lambda body: sse(*chunks))
    with pytest.raises(ModelError, match=says) as e:
        complete(client)
    assert e.value.kind == kind


def test_an_interrupted_turn_keeps_the_tokens_that_arrived():
    cancel = threading.Event()
    client, _ = mocked_client(lambda body: sse(
        delta("", [], None, prompt_token_ids=[1, 2]),
        delta("Hel", [10, 11], lp(-0.5, -0.25)),
        delta("lo", [12], lp(-1.0))))
    with pytest.raises(ModelError) as e:
        complete(client, StreamCallbacks(on_text=lambda text: cancel.set()), cancel)
    assert e.value.kind == "interrupted"
    t = e.value.partial.tokens
    assert (t.prompt_token_ids, t.completion_token_ids, t.completion_logprobs) == ([1, 2], [10, 11], [-0.5, -0.25])


def test_routes_are_kept_from_a_position_on_and_malformed_ones_dropped():
    import base64

    from agent.client import routes_from

    rows = bytes(range(24))  # 6 tokens x 2 layers x 2 experts, uint8
    routes = {"start": 0, "shape": [6, 2, 2], "dtype": "uint8", "data": base64.b64encode(rows).decode()}
    kept = routes_from(routes, 4)
    assert kept["start"] == 4 and kept["shape"] == [2, 2, 2] and base64.b64decode(kept["data"]) == rows[16:]
    assert routes_from(routes, 0) == routes
    assert routes_from(routes | {"shape": [7, 2, 2]}, 0) is None  # the data does not fill the shape
    assert routes_from(routes | {"data": "not base64!"}, 0) is None
    assert routes_from(routes | {"dtype": "float32"}, 0) is None
    assert routes_from(routes, 7) is None


def test_the_client_reports_the_servers_cached_prompt_tokens(server):
    """Against the real composer-serve: an agent's next request extends its last one, and the usage the
    client reports says the history came from the server's prefix cache."""
    client = OpenAIClient(Config(model="tiny", base_url=server.base_url, temperature=0.0, max_output_tokens=6))
    messages = [{"role": "system", "content": "a session of its own: " + "x" * 20 + str(threading.get_ident())},
                {"role": "user", "content": "what does main.py do?"}]
    first = client.complete(messages, None, StreamCallbacks(), threading.Event())
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "and utils.py?"}]
    second = client.complete(messages, None, StreamCallbacks(), threading.Event())
    assert first.usage.prompt_tokens // 16 * 16 <= second.usage.cached_tokens < second.usage.prompt_tokens
