"""The loop in-process (DeterministicModel and the real client on loopback), config, and compaction."""

from __future__ import annotations

import json
import threading
import time

import pytest

from agent.client import ModelError, OpenAIClient, StreamCallbacks, estimate_tokens
from agent.config import Config, ConfigError, load_config
from agent.context import SUMMARY_HEADER, compact, system_prompt
from agent.protocol import event_from_json
from agent.runtime import build, repair
from agent.scripted import DeterministicModel, ScriptedServer


def run_in_process(tmp_path, turns, task="do it", config=None, model=None, **kw):
    events = []
    model = model or DeterministicModel(turns)
    rt = build(config or Config(), tmp_path, emit=events.append, model=model, **kw)
    finished = rt.agent.run(task, rt.system)
    rt.session.close()
    return finished, events, model


def test_events_round_trip_and_order(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n")
    turns = [{"reasoning": "look first", "content": "Reading.",
              "tool_calls": [{"name": "read_file", "arguments": {"path": "a.txt"}}]},
             {"content": "It says hello."}]
    finished, events, model = run_in_process(tmp_path, turns)
    assert finished.status == "completed" and finished.final_text == "It says hello." and finished.turns == 2
    types = [e.type for e in events]
    assert types[:3] == ["session_started", "turn_started", "reasoning_delta"]
    assert types.index("assistant_message") < types.index("tool_call_finished") or "tool_call_started" in types
    for e in events:
        assert event_from_json(e.to_json()) == e
    assert model.requests[1]["messages"][-1]["content"].startswith("     1\thello")


def test_token_budget_stops_the_run(tmp_path):
    loop = [{"tool_calls": [{"name": "list_dir", "arguments": {}}]}] * 10
    finished, _, _ = run_in_process(tmp_path, loop, config=Config(token_budget=5000))
    assert finished.status == "max_tokens" and 1 <= finished.turns < 10


class OverflowOnce(DeterministicModel):
    """Answers the first tool-bearing request with the server's context-length error."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.raised = False

    def complete(self, messages, tools, cb, cancel):
        if tools and not self.raised:
            self.raised = True
            raise ModelError("the prompt is too long for the model: maximum context length exceeded",
                             "context_overflow", 400)
        return super().complete(messages, tools, cb, cancel)


def test_a_context_overflow_error_triggers_a_summary_and_a_retry(tmp_path):
    model = OverflowOnce([{"content": "finished"}], summaries=["## Goal\nG"])
    finished, events, _ = run_in_process(tmp_path, [], model=model)
    assert finished.status == "completed" and finished.final_text == "finished"
    assert [e.type for e in events].count("summary") == 1


def test_system_prompt_includes_agents_md(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "xdg" / "composer").mkdir(parents=True)
    (tmp_path / "xdg" / "composer" / "AGENTS.md").write_text("Always answer in French.")
    (tmp_path / "AGENTS.md").write_text("Run `make check` before finishing.")
    text = system_prompt(tmp_path)
    assert "Run `make check` before finishing." in text and "Always answer in French." in text
    assert str(tmp_path) in text and "Not a git repository" in text


def test_compaction_keeps_user_instructions_and_whole_turns():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "task one"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function",
                                                                  "function": {"name": "x", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "r" * 40000},
            {"role": "user", "content": "also: use tabs"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "b", "type": "function",
                                                                  "function": {"name": "x", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "b", "content": "small"}]
    out = compact(msgs, "SUMMARY", window=8000)
    assert out[0] == msgs[0]
    assert out[1:3] == [msgs[1], msgs[4]]  # the user's own words, verbatim
    assert out[3]["content"] == SUMMARY_HEADER + "SUMMARY"
    assert out[4:] == msgs[5:]  # the last whole turn; the huge one did not fit
    again = compact(out + [{"role": "user", "content": "third"}], "S2", window=8000)
    assert [m["content"] for m in again[1:5]] == ["task one", "also: use tabs", "third", SUMMARY_HEADER + "S2"]


def test_repair_answers_dangling_tool_calls():
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "x", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "x", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "ok"}]
    fixed = repair(msgs)
    assert fixed[-1]["tool_call_id"] == "b" and "interrupted" in fixed[-1]["content"]


def test_config_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "xdg" / "composer").mkdir(parents=True)
    (tmp_path / "xdg" / "composer" / "config.toml").write_text(
        'base_url = "http://user:1/v1"\nmodel = "user-model"\napproval = "read-only"\n')
    (tmp_path / ".composer").mkdir()
    (tmp_path / ".composer" / "config.toml").write_text(
        'model = "repo-model"\ncontext_window = 4096\n[lint]\n"*.go" = "go vet ./..."\n')
    cfg = load_config(tmp_path, {}, env={})
    assert (cfg.base_url, cfg.model, cfg.approval, cfg.context_window) == (
        "http://user:1/v1", "repo-model", "read-only", 4096)
    assert cfg.linters == {"*.go": "go vet ./..."}
    cfg = load_config(tmp_path, {"model": None}, env={"COMPOSER_MODEL": "env-model", "COMPOSER_CONTEXT_WINDOW": "9000"})
    assert cfg.model == "env-model" and cfg.context_window == 9000
    cfg = load_config(tmp_path, {"model": "flag-model"}, env={"COMPOSER_MODEL": "env-model"})
    assert cfg.model == "flag-model"
    (tmp_path / ".composer" / "config.toml").write_text("modle = 'typo'\n")
    with pytest.raises(ConfigError, match="modle"):
        load_config(tmp_path, {}, env={})
    with pytest.raises(ConfigError, match="approval"):
        Config(approval="sometimes")


def test_client_reads_a_non_streamed_answer_and_reports_usage(tmp_path):
    turns = [{"no_stream": True, "content": "whole", "tool_calls": [{"name": "glob", "arguments": {"pattern": "*"}}]}]
    with ScriptedServer(turns) as srv:
        client = OpenAIClient(Config(base_url=srv.base_url))
        assert client.check() == ("scripted-model", 32768)
        got = []
        turn = client.complete([{"role": "user", "content": "hi"}], [{"type": "function", "function": {
            "name": "glob", "parameters": {"type": "object", "properties": {}}}}],
            StreamCallbacks(on_tool_call=got.append), threading.Event())
    assert turn.content == "whole" and [c.name for c in got] == ["glob"]
    assert json.loads(turn.tool_calls[0].arguments) == {"pattern": "*"}
    assert (turn.usage.prompt_tokens, turn.usage.completion_tokens, turn.usage.estimated) == (11, 7, False)


def test_client_gives_up_after_max_retries(tmp_path):
    with ScriptedServer([{"status": 502}] * 3) as srv:
        client = OpenAIClient(Config(base_url=srv.base_url, max_retries=2))
        client.check()
        retries = []
        cb = StreamCallbacks(on_retry=lambda a, d, r: retries.append(a))
        client_sleep = threading.Event()
        with pytest.raises(ModelError) as e:
            client.complete([{"role": "user", "content": "x"}], [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {}}}}], cb, client_sleep)
    assert e.value.kind == "server" and "gave up after 2 retries" in str(e.value) and retries == [1, 2]


def checked_client(srv: ScriptedServer) -> OpenAIClient:
    client = OpenAIClient(Config(base_url=srv.base_url))
    client.check()
    return client


def test_a_stream_broken_after_a_tool_call_started_is_not_retried(tmp_path):
    """The first call was already handed to the executor when the connection broke: asking again would
    run it twice. The loop keeps the answer as far as it came (the unfinished second call is dropped),
    and stops: the answer was cut, the run did not complete. Resuming goes on from there."""
    turns = [{"content": "Two steps.", "drop": True, "tool_calls": [
                 {"name": "shell", "arguments": {"command": "echo ran >> once.log"}},
                 {"name": "shell", "arguments": {"command": "echo ran >> never.log"}}]},
             {"content": "done"}]
    with ScriptedServer(turns) as srv:
        finished, events, _ = run_in_process(tmp_path, None, model=checked_client(srv))
        assert finished.status == "error" and "RemoteProtocolError" in finished.error
        assert (tmp_path / "once.log").read_text() == "ran\n" and not (tmp_path / "never.log").exists()
        assert not [e for e in events if e.type == "retrying"]
        finished, _, _ = run_in_process(tmp_path, None, task="go on", model=checked_client(srv),
                                        resume=finished.session_id)
        requests = srv.chat_requests()
    assert finished.status == "completed" and finished.final_text == "done"
    assert (tmp_path / "once.log").read_text() == "ran\n" and len(requests) == 2
    assistant = [m for m in requests[1]["messages"] if m["role"] == "assistant"]
    assert len(assistant) == 1 and len(assistant[0]["tool_calls"]) == 1


def test_a_stream_that_ends_without_done_or_finish_reason_is_retried(tmp_path):
    """A server that dies mid-answer may close the stream cleanly: without [DONE] or a finish_reason the
    text is cut, not final, so it is asked again instead of being accepted as the answer."""
    turns = [{"content": "The answer is 4", "cut": True}, {"content": "The answer is 42."}]
    with ScriptedServer(turns) as srv:
        finished, events, _ = run_in_process(tmp_path, None, model=checked_client(srv))
        requests = srv.chat_requests()
    assert finished.status == "completed" and finished.final_text == "The answer is 42."
    retries = [e for e in events if e.type == "retrying"]
    assert len(retries) == 1 and "[DONE]" in retries[0].reason and len(requests) == 2


def test_an_error_in_the_stream_is_retried_with_its_message(tmp_path):
    turns = [{"content": "Half an", "stream_error": "engine stopped: CUDA error"}, {"content": "A whole answer."}]
    with ScriptedServer(turns) as srv:
        finished, events, _ = run_in_process(tmp_path, None, model=checked_client(srv))
    assert finished.status == "completed" and finished.final_text == "A whole answer."
    retries = [e for e in events if e.type == "retrying"]
    assert len(retries) == 1 and "engine stopped: CUDA error" in retries[0].reason


def test_a_stream_cut_after_a_tool_call_started_stops_with_a_clear_status(tmp_path):
    """Cut (cleanly) after the first call was handed to the executor: that call runs once, the half-sent
    second one never runs, nothing is asked again, and the run ends as an error saying so, not as a
    completed answer; the session holds the call and its result, so it can be resumed."""
    turns = [{"content": "Two steps.", "cut": True, "tool_calls": [
                 {"name": "shell", "arguments": {"command": "echo ran >> once.log"}},
                 {"name": "shell", "arguments": {"command": "echo ran >> never.log"}}]},
             {"content": "done"}]
    with ScriptedServer(turns) as srv:
        finished, events, _ = run_in_process(tmp_path, None, model=checked_client(srv))
        requests = srv.chat_requests()
    assert finished.status == "error" and "cut off" in finished.error and finished.final_text == ""
    assert (tmp_path / "once.log").read_text() == "ran\n" and not (tmp_path / "never.log").exists()
    assert len(requests) == 1 and not [e for e in events if e.type == "retrying"]
    messages = [json.loads(line) for line in next((tmp_path / ".composer" / "sessions").glob("*.jsonl")).open()]
    kept = [m["message"] for m in messages if m.get("type") == "message"]
    assert [m["role"] for m in kept[-2:]] == ["assistant", "tool"] and len(kept[-2]["tool_calls"]) == 1


def test_a_stream_broken_before_any_call_is_retried(tmp_path):
    turns = [{"content": "Let me", "drop": True}, {"content": "done"}]
    with ScriptedServer(turns) as srv:
        finished, events, _ = run_in_process(tmp_path, None, model=checked_client(srv))
    assert finished.status == "completed" and finished.final_text == "done"
    retries = [e for e in events if e.type == "retrying"]
    assert len(retries) == 1 and "RemoteProtocolError" in retries[0].reason


@pytest.mark.parametrize("headers_late", [False, True], ids=["headers-first", "nothing-sent"])
def test_an_interrupt_during_a_slow_prefill_closes_the_connection_at_once(tmp_path, headers_late):
    """Esc during a prefill that sends nothing for seconds: the turn ends within ~100 ms, the status bar
    keeps a sane speed and the real context figure, and the session goes on when resumed."""
    from agent.render import Status

    turns = [{"content": "Looking.", "tool_calls": [{"name": "list_dir", "arguments": {}}], "prompt_tokens": 120},
             {"content": "never sent", "prefill_s": 8, "headers_late": headers_late},
             {"content": "resumed fine"}]
    with ScriptedServer(turns) as srv:
        config = Config(base_url=srv.base_url)
        events: list = []
        rt = build(config, tmp_path, emit=events.append)
        result: list = []
        worker = threading.Thread(target=lambda: result.append(rt.agent.run("look", rt.system)))
        worker.start()
        deadline = time.monotonic() + 20
        while len(srv.chat_requests()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the server is in its prefill now
        start = time.monotonic()
        rt.agent.interrupt()
        worker.join(5)
        took = time.monotonic() - start
        rt.session.close()
        assert not worker.is_alive() and result[0].status == "interrupted"
        assert took < 0.5, f"the interrupt took {took:.2f} s"
        status = Status()
        for e in events:
            status.apply(e)
        usage = [e for e in events if e.type == "usage"]
        assert usage[-1].tokens_per_s < 10_000 and (status.tokens_per_s or 0) < 10_000
        assert status.context_used >= usage[0].prompt_tokens + usage[0].completion_tokens
        # the server counts far fewer tokens than 4 characters a token (turn 1: 120): after the
        # interrupt the bar shows that real figure plus the few messages since, not a whole-prompt estimate
        estimate = estimate_tokens(srv.chat_requests()[1]["messages"]) + estimate_tokens(srv.chat_requests()[1]["tools"])
        assert usage[0].prompt_tokens == 120 and estimate > 5 * 120
        assert status.context_used < 2 * 120 + 200, (status.context_used, estimate)
        again = build(config, tmp_path, emit=lambda e: None, resume=rt.session.id)
        finished = again.agent.run("go on", again.system)
        again.session.close()
    assert finished.status == "completed" and finished.final_text == "resumed fine"
    sent = srv.chat_requests()[-1]["messages"]
    assert [m["role"] for m in sent][:4] == ["system", "user", "assistant", "tool"] and sent[-1]["content"] == "go on"
