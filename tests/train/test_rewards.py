"""train.rewards on real session files: malformed-call counting, the length penalty's shape, compose()."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent import session as sessions
from agent.protocol import tool_call_message
from agent.session import Session
from train.rewards import (
    EpisodeStats,
    RewardConfig,
    compose,
    episode_stats,
    length_penalty,
    malformed_penalty,
    parallelism_bonus,
    pass_reward,
)

SPECS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "list_dir", "description": "List a folder.", "parameters": {
        "type": "object", "properties": {}}}},
]

Call = tuple[str, Any]  # (name, arguments: JSON text, or anything else to be JSON-encoded)


def record_episode(folder: Path, turns: list[tuple[str, list[Call], int]], status: str | None = "completed",
                   summary_after: int | None = None) -> Path:
    """Write a session the way agent/loop.py does: request record, assistant message, tool results."""
    s = Session.create(folder, tools=SPECS, model="m")
    s.add_message({"role": "system", "content": "sys"})
    s.add_message({"role": "user", "content": "fix the bug"})
    last_assistant: dict[str, Any] = {}
    for turn, (content, calls, tokens) in enumerate(turns, 1):
        s.write({"type": "request", "turn": turn, "segment": s.segment, "messages": s.sent_count(), "extra": [],
                 "purpose": "turn", "usage": {"prompt_tokens": 500, "completion_tokens": tokens}})
        ids = [f"call_{turn}_{i}" for i in range(len(calls))]
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [tool_call_message(i, name, args if isinstance(args, str) else json.dumps(args))
                                 for i, (name, args) in zip(ids, calls, strict=True)]
        s.add_message(msg)
        last_assistant = msg
        for i in ids:
            s.add_message({"role": "tool", "tool_call_id": i, "content": "ok"})
        if calls:
            s.write({"type": "tools", "turn": turn, "calls": [
                {"id": i, "name": n, "ok": True, "duration_s": 0.01} for i, (n, _) in zip(ids, calls, strict=True)]})
        if turn == summary_after:
            # Summary request, new segment, and the recent messages re-appended (as compact() keeps them).
            s.write({"type": "request", "turn": turn, "segment": s.segment, "messages": s.sent_count(),
                     "extra": [{"role": "user", "content": "summarise"}], "purpose": "summary",
                     "usage": {"prompt_tokens": 900, "completion_tokens": 70}})
            s.new_segment("summary text", 900)
            s.add_message({"role": "system", "content": "sys"})
            s.add_message({"role": "user", "content": "summary text"})
            s.add_message(last_assistant)
    if status is not None:
        s.write({"type": "finished", "status": status, "turns": len(turns), "duration_s": 1.0})
    s.close()
    return s.path


def stats_of(tmp_path: Path, turns, passed: bool | None = True, **kw) -> EpisodeStats:
    return episode_stats(sessions.load(record_episode(tmp_path, turns, **kw)), passed)


def stats(**kw) -> EpisodeStats:
    base = dict(passed=True, status="completed", turns=3, completion_tokens=1000, tool_calls=2,
                malformed_tool_calls=0, tool_calls_per_turn=1.0, infra_error=False)
    return EpisodeStats(**{**base, **kw})


# -- episode_stats -------------------------------------------------------------------------------------------

def test_a_clean_episode(tmp_path):
    st = stats_of(tmp_path, [("Reading both.", [("read_file", {"path": "a.py"}), ("read_file", {"path": "b.py"})], 40),
                             ("", [("list_dir", {})], 10),
                             ("Done.", [], 25)])
    assert st == EpisodeStats(passed=True, status="completed", turns=3, completion_tokens=75, tool_calls=3,
                              malformed_tool_calls=0, tool_calls_per_turn=1.5, infra_error=False)


def test_each_kind_of_malformed_call_is_counted(tmp_path):
    st = stats_of(tmp_path, [
        ("", [("rm_rf", {"path": "/"}),                    # not a tool of this session
              ("read_file", '{"path": "a.py"'),            # not JSON
              ("read_file", '["a.py"]'),                   # JSON, not an object
              ("read_file", {"limit": 5}),                 # schema: path missing
              ("read_file", {"path": "a.py", "limit": "5"}),  # schema: wrong type (no coercion)
              ("read_file", {"path": "a.py", "limit": 5}),    # fine
              ("list_dir", "")], 100),                     # fine: empty arguments mean {}
        ('Let me look. <tool_call>{"name": "read_file", "arguments": {"path": "a.py"', [], 30),
        ("<tool_call>\n<function=read_file><parameter=path>a.py</parameter></function> and <function=list_dir>",
         [], 30),
    ], passed=False)
    # 5 bad structured calls + 1 hermes tag + 2 qwen3_coder attempts (the wrapped one counted once)
    assert st.malformed_tool_calls == 8
    assert st.tool_calls == 7 and st.turns == 3 and st.tool_calls_per_turn == 7.0


def test_summaries_count_tokens_but_copies_are_not_recounted(tmp_path):
    turns = [("", [("read_file", {"path": "a.py"}), ("rm_rf", {})], 50), ("Done.", [], 20)]
    st = stats_of(tmp_path, turns, summary_after=1)
    assert st.turns == 2 and st.completion_tokens == 50 + 70 + 20
    assert st.tool_calls == 2 and st.malformed_tool_calls == 1


@pytest.mark.parametrize("status, infra", [("completed", False), ("max_turns", False), ("error", True),
                                           (None, True)])
def test_infra_error(tmp_path, status, infra):
    st = stats_of(tmp_path, [("Done.", [], 5)], passed=None, status=status)
    assert st.infra_error is infra and st.status == status and st.passed is None


def test_an_episode_recorded_by_the_real_loop(tmp_path):
    from agent.config import Config
    from agent.runtime import build
    from agent.scripted import DeterministicModel

    (tmp_path / "a.txt").write_text("hello\n")
    model = DeterministicModel([
        {"content": "Reading.", "tool_calls": [{"name": "read_file", "arguments": {"path": "a.txt"}},
                                               {"name": "read_file", "arguments": {"nope": 1}}]},
        {"content": "It says hello."}])
    rt = build(Config(), tmp_path, emit=lambda e: None, model=model)
    finished = rt.agent.run("read a.txt", rt.system)
    rt.session.close()
    st = episode_stats(sessions.load(rt.session.path), passed=True)
    assert finished.status == "completed"
    assert (st.turns, st.tool_calls, st.malformed_tool_calls, st.infra_error) == (2, 2, 1, False)
    assert st.completion_tokens == finished.completion_tokens > 0


# -- reward functions ----------------------------------------------------------------------------------------

def test_pass_reward():
    assert pass_reward(stats(passed=True)) == 1.0
    assert pass_reward(stats(passed=False)) == 0.0 and pass_reward(stats(passed=None)) == 0.0


def test_length_penalty_formula():
    assert length_penalty(stats(completion_tokens=1000)) == pytest.approx(-0.1 * math.log1p(1.0))
    assert length_penalty(stats(completion_tokens=0)) == 0.0


def marginal(tokens: int, task: dict | None = None) -> float:
    """Extra penalty for 100 more tokens (positive)."""
    return length_penalty(stats(completion_tokens=tokens), task) - length_penalty(
        stats(completion_tokens=tokens + 100), task)


def test_length_penalty_is_concave_and_costs_most_on_easy_tasks():
    assert marginal(200) > marginal(5000) > 0
    # The same 100 tokens cost less on a task expected to need more of them, at any length.
    for tokens in (200, 5000, 50_000):
        assert marginal(tokens, {"expected_tokens": 20_000}) < marginal(tokens, {"expected_tokens": 500})
    assert length_penalty(stats(completion_tokens=3000), {"expected_tokens": 20_000}) > length_penalty(
        stats(completion_tokens=3000), {"expected_tokens": 500})


def test_length_penalty_is_bounded_and_spares_failures():
    huge = stats(completion_tokens=10**12)
    assert length_penalty(huge) == -0.5 and pass_reward(huge) + length_penalty(huge) > 0
    assert length_penalty(stats(passed=False, completion_tokens=5000)) == 0.0
    assert length_penalty(stats(passed=None, completion_tokens=5000)) == 0.0
    assert length_penalty(stats(passed=False, completion_tokens=5000), only_passed=False) < 0
    with pytest.raises(ValueError, match="expected_tokens"):
        length_penalty(stats(), {"expected_tokens": 0})


def test_malformed_penalty_is_per_call_and_capped():
    assert malformed_penalty(stats(malformed_tool_calls=0)) == 0.0
    assert malformed_penalty(stats(malformed_tool_calls=2)) == pytest.approx(-0.2)
    assert malformed_penalty(stats(passed=False, malformed_tool_calls=40)) == pytest.approx(-0.5)


def test_parallelism_bonus():
    assert parallelism_bonus(stats(tool_calls_per_turn=1.0)) == 0.0
    assert parallelism_bonus(stats(tool_calls_per_turn=2.0)) == pytest.approx(0.05)
    assert parallelism_bonus(stats(tool_calls_per_turn=30.0)) == pytest.approx(0.1)
    assert parallelism_bonus(stats(passed=False, tool_calls_per_turn=3.0)) == 0.0


# -- config and compose --------------------------------------------------------------------------------------

def test_compose_totals_and_components():
    reward = compose(RewardConfig(parallel_coef=0.05))
    st = stats(completion_tokens=1000, malformed_tool_calls=1, tool_calls_per_turn=3.0)
    total, parts = reward(st, None)
    expected = {"pass": 1.0, "length": -0.1 * math.log1p(1.0), "malformed": -0.1, "parallel": 0.1,
                "evidence": 0.0, "turns": 0.0, "calls": 0.0}
    assert parts == pytest.approx(expected) and total == pytest.approx(sum(expected.values()))
    total, parts = reward(replace(st, passed=False), {"expected_tokens": 100})
    assert parts == pytest.approx({"pass": 0.0, "length": 0.0, "malformed": -0.1, "parallel": 0.0,
                                   "evidence": 0.0, "turns": 0.0, "calls": 0.0})
    assert total == pytest.approx(-0.1)


def test_defaults_leave_parallelism_off():
    _, parts = compose(RewardConfig())(stats(tool_calls_per_turn=4.0), None)
    assert parts["parallel"] == 0.0 and parts["pass"] == 1.0


def test_compose_refuses_infra_errors():
    with pytest.raises(ValueError, match="mask it out"):
        compose(RewardConfig())(stats(status="error", infra_error=True), None)


def test_config_from_dict():
    cfg = RewardConfig.from_dict({"pass_weight": 2, "length_coef": 0.2, "length_only_passed": False})
    assert cfg.pass_weight == 2.0 and isinstance(cfg.pass_weight, float) and cfg.length_only_passed is False
    with pytest.raises(ValueError, match=r"unknown reward config keys \['lenght_coef'\]"):
        RewardConfig.from_dict({"lenght_coef": 0.2})


@pytest.mark.parametrize("kwargs, match", [
    ({"length_coef": -0.1}, "length_coef"),
    ({"malformed_cap": math.inf}, "malformed_cap"),
    ({"pass_weight": "1"}, "pass_weight"),
    ({"length_only_passed": 1}, "length_only_passed"),
    ({"length_scale": 0}, "length_scale"),
    ({"length_cap": 1.0}, "length_cap"),
    ({"evidence_cap": 0.5}, r"length_cap 0.5 \+ evidence_cap 0.5 = 1.0 must be below pass_weight"),
    ({"turn_cost": 0.01, "turn_cap": 0.3}, "turn_cap"),
    ({"free_turns": -1}, "free_turns"),
    ({"efficiency_only_passed": "yes"}, "efficiency_only_passed"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardConfig(**kwargs)


# -- evidence and efficiency -----------------------------------------------------------------------------------

CLAIM_SESSIONS = Path(__file__).parents[1] / "agent" / "tasks" / "sessions"  # real recorded sessions


@pytest.mark.parametrize("name, passed, counts, evidence", [
    ("expert-bugfix-passed.jsonl", True, (3, 0, 0), 0.0),
    ("builtin-bugfix-wrong-file.jsonl", False, (3, 0, 3), -0.3),  # 3 contradicted: 0.6, capped at 0.3
    ("builtin-bugfix-edit-missed.jsonl", False, (3, 0, 2), -0.3),
    ("builtin-find-def.jsonl", True, (1, 1, 0), -0.1),  # a line number it never saw, in a passing answer
])
def test_evidence_on_real_sessions(name, passed, counts, evidence):
    st = episode_stats(sessions.load(CLAIM_SESSIONS / name), passed)
    assert (st.claims, st.unsupported_claims, st.contradicted_claims) == counts
    _, parts = compose(RewardConfig())(st, None)
    assert parts["evidence"] == pytest.approx(evidence)
    _, off = compose(RewardConfig(evidence_unsupported=0, evidence_contradicted=0))(st, None)
    assert off["evidence"] == 0.0


def test_turn_and_call_costs():
    cfg = RewardConfig(turn_cost=0.02, free_turns=2, call_cost=0.01, call_cap=0.05)
    _, parts = compose(cfg)(stats(turns=7, tool_calls=9), None)
    assert parts["turns"] == pytest.approx(-0.1) and parts["calls"] == pytest.approx(-0.05)  # calls capped
    _, parts = compose(cfg)(stats(passed=False, turns=7, tool_calls=9), None)
    assert parts["turns"] == 0.0 and parts["calls"] == 0.0  # failing fast must not pay better than trying
    _, parts = compose(replace(cfg, efficiency_only_passed=False))(stats(passed=False, turns=7, tool_calls=9), None)
    assert parts["turns"] == pytest.approx(-0.1)
