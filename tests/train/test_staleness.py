"""The staleness bound and infra masking of the RL loop, on real Episode/Sample objects."""

from __future__ import annotations

from agent.tasks import Task
from train.algo import LossConfig
from train.rl import RLConfig, advantages_for
from train.rollout import Episode
from train.rollouts import tasks_for_batch
from train.samples import Sample


def ep(group: int, reward: float, version: int, infra: str | None = None) -> Episode:
    s = Sample(f"e{group}-{reward}-{version}", 0, [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [version], 1)
    return Episode("t", group, "completed", reward=reward, samples=[] if infra else [s], infra_error=infra)


def test_stale_episodes_are_dropped_and_infra_failures_masked():
    cfg = RLConfig(max_staleness=1)
    episodes = [ep(0, 1.0, 4), ep(0, 0.0, 4), ep(0, 0.0, 3),  # version 3 at step 5: 2 behind, dropped
                ep(1, 1.0, 5), ep(1, 0.0, 5, infra="HTTP 500"), ep(1, 1.0, 4)]
    samples, advs, counts = advantages_for(episodes, version=5, cfg=cfg, loss=LossConfig())
    assert counts == {"infra_masked": 1, "dropped_stale": 1, "groups_skipped": 0}
    assert len(samples) == 4
    # group 0 keeps rewards [1, 0] -> +-0.5; group 1 keeps [1, 1] -> 0 (the failure is not scored 0)
    assert advs == [0.5, -0.5, 0.0, 0.0]


def test_synchronous_drops_anything_older_than_the_current_policy():
    samples, _, counts = advantages_for([ep(0, 1.0, 2), ep(0, 0.0, 3), ep(0, 1.0, 3)], version=3,
                                        cfg=RLConfig(max_staleness=0), loss=LossConfig())
    assert counts["dropped_stale"] == 1 and len(samples) == 2


def test_a_group_left_with_one_episode_is_skipped():
    samples, _, counts = advantages_for([ep(0, 1.0, 0), ep(0, 0.0, 0, infra="timeout")], version=0,
                                        cfg=RLConfig(), loss=LossConfig())
    assert samples == [] and counts["groups_skipped"] == 1


def test_shuffled_rewards_control_permutes_rewards_within_the_step():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0, 0.0, 0.0, 1.0]
    episodes = [ep(i // 4, r, 0) for i, r in enumerate(rewards)]
    real = advantages_for(episodes, version=0, cfg=RLConfig(), loss=LossConfig())[1]
    shuffled = [advantages_for(episodes, version=k, cfg=RLConfig(shuffle_rewards=True, seed=1), loss=LossConfig())[1]
                for k in range(4)]
    again = advantages_for(episodes, version=0, cfg=RLConfig(shuffle_rewards=True, seed=1), loss=LossConfig())[1]
    assert shuffled[0] == again  # drawn from seed and step
    assert all(s != real for s in shuffled) and len({tuple(s) for s in shuffled}) > 1
    for s in shuffled:  # every group's advantages still sum to 0; the episodes keep their true rewards
        assert all(abs(sum(s[g * 4:(g + 1) * 4])) < 1e-6 for g in range(3))
    assert [e.reward for e in episodes] == rewards


def test_task_order_is_a_function_of_seed_and_batch(tmp_path):
    tasks = [Task(f"t{i}", "p", "true", workspace=str(tmp_path)) for i in range(5)]
    a = [t.id for k in range(5) for t in tasks_for_batch(tasks, k, 2, seed=3)]
    assert a == [t.id for k in range(5) for t in tasks_for_batch(tasks, k, 2, seed=3)]
    assert sorted(a[:5]) == sorted(t.id for t in tasks)  # an epoch covers every task once
    assert a != [t.id for k in range(5) for t in tasks_for_batch(tasks, k, 2, seed=4)]


def test_training_refuses_held_out_tasks(tiny, tmp_path):
    import pytest

    from agent.tasks.suites import builtin
    from train.rl import run

    with pytest.raises(ValueError, match="held-out"):
        run(tiny, builtin("synthetic-heldout", 1), tmp_path / "run", RLConfig(steps=1))
