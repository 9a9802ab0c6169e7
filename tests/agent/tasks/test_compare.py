"""`composer-agent eval compare`: the statistics by hand, and real runs through the CLI (the scripted
expert twice: no difference; the expert against a model that gives up: a significant one; runs over
different tasks: refused)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import Config
from agent.scripted import ScriptedServer
from agent.tasks.compare import bootstrap, mcnemar
from agent.tasks.eval import EvalConfig, run_eval
from agent.tasks.suites import builtin

N = 8  # 8 discordant pairs give McNemar p = 2/256; 4 could never reach 0.05 (2/16)


def test_mcnemar_and_bootstrap_by_hand():
    assert mcnemar(0, 0) == 1.0 and mcnemar(5, 5) == 1.0
    assert mcnemar(1, 3) == pytest.approx(2 * (1 + 4) / 16)  # P(X <= 1) = (C(4,0) + C(4,1)) / 2^4, twice
    assert mcnemar(0, 8) == pytest.approx(2 / 256) and mcnemar(8, 0) == mcnemar(0, 8)
    import random

    lo, hi = bootstrap([1.0] * 10, 200, random.Random(0))
    assert lo == hi == 1.0
    lo, hi = bootstrap([0.0, 1.0] * 20, 2000, random.Random(0))
    assert 0.3 < lo < 0.5 < hi < 0.7


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli", "eval", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    for name in ("expert-1", "expert-2"):
        r = _cli("synthetic-small", "--expert", "--limit", str(N), "--concurrency", "2", "--out", str(tmp / name),
                 "--no-sandbox", cwd=tmp)
        assert r.returncode == 0, r.stderr
    give_up = [{"content": "I can't help with that."}] * (N + 2)
    with ScriptedServer(give_up) as srv, open("/dev/null", "w") as quiet:
        run_eval(builtin("synthetic-small")[:N], Config(base_url=srv.base_url, model="scripted-model"),
                 EvalConfig(concurrency=1, sandbox=False), tmp / "give-up", log=quiet)
    return tmp


def test_the_same_model_twice_is_no_difference(runs):
    r = _cli("compare", str(runs / "expert-1"), str(runs / "expert-2"), "--out", str(runs / "c1"), cwd=runs)
    assert r.returncode == 0, r.stderr
    res = json.loads((runs / "c1" / "compare.json").read_text())
    assert res["tasks"] == N and res["pass"]["delta"] == 0 and res["pass"]["mcnemar_p"] == 1.0
    assert not res["pass"]["significant"] and "no significant difference" in r.stdout
    assert res["deltas"]["completion_tokens"]["delta"] == 0  # the expert says the same every time
    assert (runs / "c1" / "compare.png").stat().st_size > 0


def test_a_model_that_gives_up_differs_significantly(runs):
    r = _cli("compare", str(runs / "give-up"), str(runs / "expert-1"), cwd=runs)
    assert r.returncode == 0, r.stderr
    res = json.loads((runs / "expert-1" / "compare.json").read_text())  # --out defaults to RUN_B
    p = res["pass"]
    assert p["a"] == 0 and p["b"] == 1 and p["delta"] == 1 and p["ci"] == [1, 1]
    assert (p["a_only"], p["b_only"]) == (0, N) and p["mcnemar_p"] == pytest.approx(2 / 2 ** N, abs=1e-6)
    assert p["significant"] and "a significant difference" in r.stdout
    assert res["deltas"]["tool_calls"]["delta"] > 0 and len(res["changed_tasks"]) == N
    assert "| all | 8 | 0.0 | 1.0 | +1.000 |" in r.stdout


def test_runs_over_different_tasks_are_refused(runs, tmp_path):
    r = _cli("synthetic-small", "--expert", "--limit", "2", "--out", str(tmp_path / "two"), "--no-sandbox",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = _cli("compare", str(runs / "expert-1"), str(tmp_path / "two"), cwd=tmp_path)
    assert r.returncode == 2 and "different tasks: 6 only in A" in r.stderr
    assert not (tmp_path / "two" / "compare.json").exists()
    r = _cli("compare", str(runs / "expert-1"), str(tmp_path / "nothing"), cwd=tmp_path)
    assert r.returncode == 2 and "no results.jsonl" in r.stderr


def test_the_seed_reaches_every_request(tmp_path):
    """Two seeds are two reproducible samples only if the server is sent the seed each time."""
    task = builtin("synthetic-small")[1]  # find-def: one grep, then the answer
    turns = [{"tool_calls": [{"name": "grep", "arguments": {"pattern": "def "}}]}, {"content": "It is in pkg/x.py."}]
    with ScriptedServer(turns) as srv, open("/dev/null", "w") as quiet:
        run_eval([task], Config(base_url=srv.base_url, model="scripted-model", seed=7), EvalConfig(sandbox=False),
                 tmp_path / "out", log=quiet)
        bodies = srv.chat_requests()
    assert len(bodies) == 2 and [b.get("seed") for b in bodies] == [7, 7]


def test_seed_and_max_output_tokens_flags_reach_the_server(tmp_path):
    """What the BENCHMARKS commands pass (--seed, --max-output-tokens) is in every request the CLI sends."""
    tasks = tmp_path / "tasks.jsonl"
    from agent.tasks.spec import write_tasks

    write_tasks([builtin("synthetic-small")[1]], tasks)
    with ScriptedServer([{"content": "I don't know."}]) as srv:
        r = _cli(str(tasks), "--base-url", srv.base_url, "--seed", "3", "--max-output-tokens", "96", "--out",
                 str(tmp_path / "out"), "--no-sandbox", cwd=tmp_path)
        bodies = srv.chat_requests()
    assert r.returncode == 0, r.stderr
    assert bodies and all(b.get("seed") == 3 and b.get("max_tokens") == 96 for b in bodies)
