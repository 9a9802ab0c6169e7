"""The expert's trajectories, recorded through the real harness, are token-exact for the model's chat
format: each episode is one append-only sample, and SFT trains on them."""

from __future__ import annotations

import json

from agent.session import load
from agent.tools import default_registry
from serve.chat_format import ChatFormat
from train.cli import main as train_main
from train.samples import build_samples


def test_expert_data_is_one_append_only_sample_per_episode_and_trains(tiny, expert_data, tmp_path):
    out = expert_data
    assert json.loads((out / "report.json").read_text())["overall"]["pass@1"] == 1.0
    chat = ChatFormat(tiny)
    sessions = sorted((out / "sessions").glob("*.jsonl"))
    assert len(sessions) == 4
    for path in sessions:
        data = load(path)
        samples = build_samples(data, chat=chat, spec_hash=default_registry().spec_hash())
        turns = sum(1 for rec in data.records if rec["type"] == "request")
        assert len(samples) == 1 and samples[0].requests == turns >= 2  # every turn extends the last
    # composer-train sft in this process (its main and argument parsing): a subprocess re-imported torch
    assert train_main(["sft", str(out / "sessions"), "--model", str(tiny), "--out", str(tmp_path / "sft"),
                       "--batch", "2"]) == 0
    assert (tmp_path / "sft" / "composer_policy.json").exists()


def test_rl_rollouts_run_in_the_environment_drawn_for_them(tiny, tmp_path):
    """RL episodes (train/rollout.py) with vary_environment: the system prompt names the drawn folder,
    date and git state, the expert still solves the task, and the episode still trains (samples)."""
    from agent.tasks.families import generate
    from agent.tasks.variation import draw
    from train.expert_data import ExpertTokenServer
    from train.rollout import RolloutConfig, run_episode

    task = generate("bugfix", 7, "small")
    key = next(f"k{i}" for i in range(100) if draw(f"k{i}").branch and draw(f"k{i}").dirs)
    with ExpertTokenServer(tiny, [task]) as srv:
        cfg = RolloutConfig(srv.base_url, "expert", vary_environment=True, sandbox=False)
        ep = run_episode(task, 0, cfg, variation_key=key, keep_dir=tmp_path / "varied")
        plain = run_episode(task, 0, RolloutConfig(srv.base_url, "expert", sandbox=False), keep_dir=tmp_path / "plain")
    assert ep.infra_error is None and ep.passed and ep.samples
    v = draw(key)
    system = load(ep.session_path).records[1]["message"]["content"]
    assert f"- Date: {v.date}" in system and f"- Git repository, branch {v.branch}." in system
    assert f"/{'/'.join(v.dirs)}/{v.name}\n" in system
    plain_system = load(plain.session_path).records[1]["message"]["content"]
    assert plain.passed and "- Not a git repository." in plain_system and v.date not in plain_system


def test_expert_mistakes_recover_and_sft_never_trains_the_mistake(tiny, tmp_path):
    """With expert mistakes on, a bugfix episode's first edit misses (its old_string is not in the file),
    the next turn recovers and the task passes; SFT's samples (train_failed=False) hold the failed turn as
    context only, while everything else is still trained on."""
    from agent.tasks.families import expert_plan, generate
    from train.expert_data import ExpertTokenServer
    from train.rollout import RolloutConfig, run_episode
    from train.samples import failed_turns

    task = generate("bugfix", 11, "small")
    plan = expert_plan(task, mistakes=1.0)
    assert len(plan) == len(expert_plan(task)) + 1 and sum(bool(t.get("mistake")) for t in plan) == 1
    assert expert_plan(task, mistakes=1.0) == plan  # chosen by the task, the same every time
    with ExpertTokenServer(tiny, [task], mistakes=1.0) as srv:
        ep = run_episode(task, 0, RolloutConfig(srv.base_url, "expert", sandbox=False), keep_dir=tmp_path / "ep")
    assert ep.infra_error is None and ep.passed
    data = load(ep.session_path)
    tools = [r["message"]["content"] for r in data.records if r["type"] == "message" and r["message"]["role"] == "tool"]
    assert sum(t.startswith("Error: old_string was not found") for t in tools) == 1
    assert failed_turns(data) == {1}
    requests = [r for r in data.records if r["type"] == "request"]
    (masked,) = build_samples(data, train_failed=False)
    (full,) = build_samples(data)
    assert masked.token_ids == full.token_ids
    wrong = len(requests[1]["completion_token_ids"])
    assert full.sampled_tokens - masked.sampled_tokens == wrong > 0
    start = len(requests[1]["prompt_token_ids"])
    assert masked.mask[start:start + wrong] == [0] * wrong and full.mask[start:start + wrong] == [1] * wrong
    shares = [sum(bool(t.get("mistake")) for t in expert_plan(generate("bugfix", s, "small"), 0.25))
              for s in range(200)]
    assert 30 <= sum(shares) <= 70  # about a quarter of the tasks
