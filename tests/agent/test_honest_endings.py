"""A run never claims what it did not do: an unparsed tool call is not an answer (the model is told and
asked again, then the run fails), an empty answer is not `completed`, and reward counting sees both.
`composer-agent --task` as a subprocess against a scripted OpenAI-compatible server on loopback."""

from __future__ import annotations

import pytest

from agent.scripted import ScriptedServer
from agent.session import load
from agent.toolcall_text import unparsed_calls
from train.rewards import episode_stats

from . import test_headless
from .test_headless import events, run_agent

buggy_repo = test_headless.buggy_repo  # the fixture: a git repository whose add() subtracts

# A call the parser cannot read: a Hermes block whose JSON never closes, left in the answer's text.
BROKEN_BLOCK = '<tool_call>\n{"name": "shell", "arguments": {"command": "python3 test_calc.py"\n'
# What the issue saw: the call written into the reasoning, closing tag and all.
IN_REASONING = 'I will run it. {"name": "shell", "arguments": {"command": "ls"}}</tool_call>'


def test_unparsed_calls_are_found_in_every_written_form():
    assert unparsed_calls(BROKEN_BLOCK) == ['<tool_call>\n{"name": "shell", "arguments":']
    assert unparsed_calls(IN_REASONING) == ['{"name": "shell", "arguments":']
    assert unparsed_calls("<function=read_file>\n<parameter=path>a.py") == ["<function=read_file>"]
    assert unparsed_calls("I would call the shell tool, then read calc.py.") == []
    assert unparsed_calls(None) == []


@pytest.mark.parametrize("turn", [{"content": BROKEN_BLOCK}, {"content": "", "reasoning": IN_REASONING}],
                         ids=["in-content", "in-reasoning"])
def test_an_unparsed_call_is_told_to_the_model_and_the_run_goes_on(buggy_repo, turn):
    script = [turn, {"tool_calls": [{"name": "shell", "arguments": {"command": "python3 test_calc.py"}}]},
              {"content": "The test fails: add subtracts."}]
    with ScriptedServer(script) as srv:
        p = run_agent(buggy_repo, "--task", "run the test", "--json", "--base-url", srv.base_url, "--approval", "auto")
        reqs = srv.chat_requests()
    evs = events(p.stdout)
    assert p.returncode == 0 and evs[-1]["status"] == "completed", p.stderr
    assert evs[-1]["final_text"] == "The test fails: add subtracts."
    told = reqs[1]["messages"][-1]  # the second request carries the observation
    assert told["role"] == "user" and "could not be parsed" in told["content"] and "no tool" in told["content"]
    assert any(e["type"] == "notice" and "not parsed" in e["text"] for e in evs)


def test_a_model_that_keeps_writing_unparsable_calls_ends_in_error_exit_1(buggy_repo):
    with ScriptedServer([{"content": BROKEN_BLOCK}] * 3) as srv:
        p = run_agent(buggy_repo, "--task", "run the test", "--json", "--base-url", srv.base_url)
        n = len(srv.chat_requests())
    last = events(p.stdout)[-1]
    assert p.returncode == 1 and n == 3  # asked again twice (malformed_retries = 2), then stopped
    assert last["status"] == "error" and last["error_kind"] == "malformed_tool_call", last
    assert last["final_text"] == ""
    # RL scores it (a failure with malformed calls), it does not mask it as an infrastructure error
    stats = episode_stats(load(_session(buggy_repo, last["session_id"])), passed=False)
    assert stats.malformed_tool_calls == 3 and stats.infra_error is False


def test_plain_output_of_an_unparsed_call_is_not_printed_as_an_answer(buggy_repo):
    with ScriptedServer([{"content": BROKEN_BLOCK}] * 3) as srv:
        p = run_agent(buggy_repo, "--task", "run the test", "--base-url", srv.base_url)
    assert p.returncode == 1 and "<tool_call>" not in p.stdout and p.stdout.strip() == ""
    assert "could not be parsed" in p.stderr


def test_an_empty_answer_is_not_completed(buggy_repo):
    with ScriptedServer([{"content": "   \n"}] * 2) as srv:
        p = run_agent(buggy_repo, "--task", "fix it", "--json", "--base-url", srv.base_url)
        q = run_agent(buggy_repo, "--task", "fix it", "--base-url", srv.base_url)
    last = events(p.stdout)[-1]
    assert p.returncode == 1 and last["status"] == "no_answer" and last["model_builtin"] is False
    assert q.returncode == 1 and q.stdout == "" and "empty answer" in q.stderr  # no blank line on stdout


def _session(repo, session_id: str):
    from agent.runtime import sessions_dir
    from agent.session import find_session

    return find_session(sessions_dir(repo), session_id)
