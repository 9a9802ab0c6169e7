"""The find-def experts that look instead of following a plan (agent/tasks/expert_find.py): through the
real loop, tools and index; they answer from what the tools printed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agent.config import Config
from agent.session import load
from agent.tasks import runner
from agent.tasks.expert_find import (
    SEARCH_K,
    asked_name,
    expert_server,
    find_turn,
    found_in_grep,
    found_in_search,
)
from agent.tasks.families import generate


def _episode(task, model, tmp_path):
    with expert_server([task], model) as srv:
        res = runner.run_episode(task, Config(base_url=srv.base_url, model=model), keep_dir=tmp_path, sandbox=False)
    assert res.infra_error is None, res.infra_error
    calls = [c["name"] for r in load(res.session_path).records if r["type"] == "tools" for c in r["calls"]]
    return res, calls


def test_every_find_def_prompt_names_its_function():
    for seed in (0, 1, 2, 3, 4, 5, 1_000_000, 1_000_001):
        for size in ("small", "medium", "large"):
            t = generate("find-def", seed, size)
            assert asked_name(t.prompt) == t.meta["function"], t.prompt
    assert asked_name(generate("bugfix", 0, "small").prompt) is None
    assert asked_name("rename clamp to compute_clamp everywhere") is None


@pytest.mark.slow
def test_search_expert_finds_the_definition_through_semantic_search(tmp_path):
    task = generate("find-def", 5, "small")  # a tiny repository: one module, report.py, two tests
    res, calls = _episode(task, "expert-search", tmp_path)
    assert calls == ["semantic_search"], calls  # found by the search, no grep needed
    assert res.passed, res.verify_output
    assert res.final_text == f"`{task.meta['function']}` is defined in {task.meta['module']}, line {task.meta['line']}."
    shown = [m for m in load(res.session_path).segments[0] if m.get("role") == "tool"][0]["content"]
    assert shown.startswith("built the index") and f"def {task.meta['function']}(" in shown
    from agent.tasks.claims import SUPPORTED, check_session
    (claim,) = check_session(load(res.session_path))  # the answer rests on the search's snippet
    assert (claim.kind, claim.status) == ("location", SUPPORTED), claim


def test_grep_expert_answers_from_the_grep_output(tmp_path):
    task = generate("find-def", 2, "medium")
    res, calls = _episode(task, "expert-grep", tmp_path)
    assert calls == ["grep"] and res.passed, res.verify_output
    assert f"{task.meta['module']}, line {task.meta['line']}" in res.final_text


def test_a_search_without_the_definition_falls_back_to_grep_then_gives_up():
    asked = [{"role": "user", "content": "where is clamp defined?"}]
    first = find_turn("clamp", True, asked)
    assert first["tool_calls"][0] == {"name": "semantic_search", "arguments": {"query": "clamp", "k": SEARCH_K}}
    search_call = {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "semantic_search"}}]}
    missed = "1. pkg/a.py:1-2  clamped  (score 0.5)\n     1\tdef clamped(x):\n     2\t    return x\n"
    then = find_turn("clamp", True, [*asked, search_call, {"role": "tool", "tool_call_id": "a", "content": missed}])
    assert then["tool_calls"][0]["name"] == "grep"
    grep_call = {"role": "assistant", "tool_calls": [{"id": "b", "function": {"name": "grep"}}]}
    convo = [*asked, search_call, {"role": "tool", "tool_call_id": "a", "content": missed}, grep_call]
    last = find_turn("clamp", True, [*convo, {"role": "tool", "tool_call_id": "b", "content": "No matches."}])
    assert last == {"content": "I could not find where `clamp` is defined."}
    hit = find_turn("clamp", True, [*convo, {"role": "tool", "tool_call_id": "b",
                                             "content": "1 matching line(s) in 1 file(s):\npkg/b.py:9:def clamp(x, lo):"}])
    assert hit == {"content": "`clamp` is defined in pkg/b.py, line 9."}


def test_parsers_read_only_definitions():
    out = ("built the index (no index yet): 4 files, 14 chunks in 0.9s\n\n"
           "1. tests/test_g.py:3-4  test_clamp  (score 0.7)\n     3\tdef test_clamp():\n     4\t    clamp(1)\n\n"
           "2. pkg/g.py:5-9  clamp  (score 0.6)\n     5\t@cache\n     6\tdef clamp(x):\n")
    assert found_in_search(out, "clamp") == ("pkg/g.py", 6)
    assert found_in_search(out, "lerp") is None
    assert found_in_grep("pkg/g.py:6:    clamp(x)\npkg/h.py:2:async def clamp(x):", "clamp") == ("pkg/h.py", 2)


def test_eval_rejects_a_model_that_is_not_an_expert(tmp_path):
    r = subprocess.run([sys.executable, "-m", "agent.cli", "eval", "synthetic-small", "--expert", "--model", "gpt-x",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "expert-search" in r.stderr, r.stderr
