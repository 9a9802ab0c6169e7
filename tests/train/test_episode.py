"""A multi-turn episode through the real harness, recorded token-exactly, becomes the right samples.

The episode has reasoning, two parallel tool calls (one of which fails), a second turn, one
summarisation and a final answer. The model is a token-id-speaking scripted server (token_server.py)
that renders prompts with the checkpoint's real chat format, as composer-serve does.
"""

from __future__ import annotations

import json

from agent.approval import Approvals
from agent.config import Config
from agent.context import system_prompt
from agent.runtime import build
from agent.session import load
from agent.tools import default_registry
from serve.chat_format import ChatFormat
from tests.train.token_server import TokenScriptServer, fake_route
from train.samples import build_samples, check_rendering, token_requests


def call(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


TURN1 = ("<think>\nFirst look at both files.\n</think>\n\n" + call("read_file", path="b.py") + "\n"
         + call("read_file", path="missing.py") + "<|im_end|>")
TURN2 = "<think>\nNow the big one.\n</think>\n\n" + call("read_file", path="a.py") + "<|im_end|>"
SUMMARY = "## Goal\nExplain a.py.\n## Done\nRead a.py and b.py.<|im_end|>"
TURN3 = "a.py defines add(), which returns the sum.<|im_end|>"


def run_scripted_episode(tiny, git_repo, routes: bool = False):
    """The episode above through the real harness; returns (session data, registry, completions, finished)."""
    (git_repo / "b.py").write_text("B = 1\n")
    (git_repo / "a.py").write_text("".join(f"def add{i}(a, b):\n    return a + b + {i}\n\n" for i in range(60)))
    chat = ChatFormat(tiny)
    registry = default_registry()
    system = system_prompt(git_repo)
    p1 = len(chat.render_ids([{"role": "system", "content": system}, {"role": "user", "content": "explain a.py"}],
                             registry.specs()))
    c1 = len(chat.encode(TURN1))
    window = int((p1 + c1 + 250) / 0.8)  # crossed only once a.py's content is in the context
    with TokenScriptServer(tiny, [TURN1, TURN2, TURN3], [SUMMARY], routes=routes) as srv:
        config = Config(base_url=srv.base_url, model="scripted", record_tokens=True, context_window=window,
                        approval="auto", max_turns=6)
        rt = build(config, git_repo, emit=lambda e: None, approve=Approvals("auto"))
        finished = rt.agent.run("explain a.py", rt.system)
        rt.session.close()
        completions = srv.completions
    return load(rt.session.path), registry, completions, finished


def test_episode_is_token_exact_and_masks_only_sampled_tokens(tiny, git_repo):
    chat = ChatFormat(tiny)
    data, registry, completions, finished = run_scripted_episode(tiny, git_repo)
    assert finished.status == "completed", finished
    assert finished.final_text.startswith("a.py defines add()")
    requests = token_requests(data)
    assert [r.get("purpose") for r, _ in requests] == ["turn", "turn", "summary", "turn"]

    # Recorded ids are exactly what was sampled, and the prompts are the chat format's rendering of
    # the recorded messages (check_rendering raises otherwise).
    assert [r["completion_token_ids"] for r, _ in requests] == completions
    check_rendering(data, chat)
    first = requests[0][0]
    assert first["policy_version"] == 7 and len(first["completion_logprobs"]) == len(completions[0])
    tools_turn = [m for r in data.records if r["type"] == "tools" for m in r["calls"]]
    assert [c["ok"] for c in tools_turn][:2] == [True, False]  # the parallel pair: one read failed

    # The completion ids decode to the assistant messages the loop recorded (reasoning kept with them).
    assistants = [r["message"] for r in data.records if r["type"] == "message" and r["message"]["role"] == "assistant"]
    assert assistants[0]["reasoning_content"].strip() == "First look at both files."
    assert len(assistants[0]["tool_calls"]) == 2
    assert assistants[-1]["content"] in chat.decode(completions[-1])

    samples = build_samples(data, chat=chat, spec_hash=registry.spec_hash())
    # Turns 1 and 2 chain into one sample (the template is append-only with reasoning and parallel
    # calls); the summary request and the compacted context after it start new segments.
    assert [s.requests for s in samples] == [2, 1, 1]
    for s, comps in zip(samples, [completions[:2], completions[2:3], completions[3:]], strict=True):
        sampled = [t for t, m in zip(s.token_ids, s.mask, strict=True) if m]
        assert sampled == [t for c in comps for t in c]  # the mask covers exactly the sampled tokens
        assert sum(s.mask) == sum(len(c) for c in comps)
        assert [lp for lp, m in zip(s.sampler_logprobs, s.mask, strict=True) if m][0] == -0.25
        assert s.versions == [7] * s.requests
    # Between the two sampled turns of the first sample lie exactly the tool results' tokens.
    s0 = samples[0]
    p2 = requests[1][0]["prompt_token_ids"]
    assert s0.token_ids[: len(p2)] == p2 and s0.token_ids[len(p2):] == completions[1]
    assert all(s.routes is None for s in samples)  # this server sends no routed experts


def test_routed_experts_are_recorded_once_and_line_up_with_the_tokens(tiny, git_repo):
    """Each request's record keeps the routes its prompt does not share with the request before it, and
    the samples carry, at every position, the experts the server gave for that very token."""
    data, registry, _, finished = run_scripted_episode(tiny, git_repo, routes=True)
    assert finished.status == "completed", finished
    records = [r for r, _ in token_requests(data)]
    starts = [r["routed_experts"]["start"] for r in records]
    first_read = len(records[0]["prompt_token_ids"]) + len(records[0]["completion_token_ids"]) - 1
    assert starts == [0, first_read, 0, 0]  # turn 2 continues turn 1; the summary and after start again
    for r in records:
        shape = r["routed_experts"]["shape"]
        assert r["routed_experts"]["start"] + shape[0] == len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) - 1
    samples = build_samples(data, chat=ChatFormat(tiny), spec_hash=registry.spec_hash())
    assert [s.requests for s in samples] == [2, 1, 1]
    for s in samples:
        assert s.routes.shape == (len(s.token_ids), 2, 2)
        assert s.routes[:-1].tolist() == [fake_route(t) for t in s.token_ids[:-1]]
        assert (s.routes[-1] == -1).all()  # the last sampled token was never read by the model
