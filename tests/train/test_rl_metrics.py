"""Per-step RL metrics: pass@k and best-of-K over the step's groups, evidence and efficiency averages,
and the plot that shows them (train/rl.py, train/plot.py). Episode stats come from real recorded sessions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.session import load
from train.plot import _keys, plot_metrics
from train.rewards import RewardConfig, compose, episode_stats
from train.rl import _episode_metrics, best_of_k
from train.rollout import Episode

SESSIONS = Path(__file__).parents[1] / "agent" / "tasks" / "sessions"


def ep(group: int, passed: bool, reward: float | None = None, session: str | None = None) -> Episode:
    e = Episode(f"t{group}", group, "completed", passed=passed, reward=float(passed) if reward is None else reward)
    if session:
        e.stats = episode_stats(load(SESSIONS / session), passed)
        e.reward, e.components = compose(RewardConfig())(e.stats, None)
    return e


def test_pass_at_k_and_best_of_k():
    # group 0: 1 of 4 passed; group 1: none; group 2: all
    eps = [ep(0, i == 0) for i in range(4)] + [ep(1, False, reward=-0.1 * i) for i in range(4)] + \
        [ep(2, True) for _ in range(4)]
    m = best_of_k(eps)
    assert m["pass@1"] == pytest.approx((0.25 + 0 + 1) / 3, abs=1e-4)
    assert m["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3, abs=1e-4)  # 1 - C(3,2)/C(4,2) = 0.5
    assert m["pass@4"] == pytest.approx(2 / 3, abs=1e-4) and "pass@8" not in m
    assert m["best_of_k"] == 4 and m["best_of_k_pass"] == pytest.approx(2 / 3, abs=1e-4)
    assert m["best_of_k_reward"] == pytest.approx((1 + 0 + 1) / 3, abs=1e-4)  # group 1's best is -0.0


def test_step_metrics_average_claims_turns_and_reward_terms():
    eps = [ep(0, True, session="expert-bugfix-passed.jsonl"), ep(0, False, session="builtin-bugfix-wrong-file.jsonl")]
    m = _episode_metrics(eps, version=0)
    assert m["claims_per_episode"] == 3.0 and m["unsupported_per_episode"] == 1.5  # 0 and 3 contradicted
    assert m["reward_evidence"] == pytest.approx(-0.15) and m["reward_pass"] == 0.5
    assert m["turns_mean"] == 4.5 and m["tool_calls_mean"] == 4.5
    assert m["pass@1"] == 0.5 and m["pass@2"] == 1.0


def test_the_plot_draws_every_logged_series(tmp_path):
    rows = [{"step": s, "reward_mean": 0.5, "pass_rate": 0.5, "pass@1": 0.5, "pass@4": 0.9, "best_of_k": 4,
             "best_of_k_reward": 1.0, "reward_pass": 0.5, "reward_evidence": -0.1, "unsupported_per_episode": 1.0,
             "turns_mean": 4.0} for s in range(3)]
    assert _keys(rows, ["pass_rate", "pass@*"]) == ["pass_rate", "pass@1", "pass@4"]
    assert _keys(rows, ["reward_*"]) == ["reward_pass", "reward_evidence"]  # not reward_mean
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_metrics(tmp_path / "m.jsonl", tmp_path / "m.png").stat().st_size > 5000
