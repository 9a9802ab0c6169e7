"""FirstGroups (train/rollouts.py): a step trains on the first groups to finish, not waiting on a slow
one, which is carried to a later step. Real harness episodes against the expert token server on the tiny
checkpoint's chat format; the verify command sleeps, so the slow task is slow for real."""

from __future__ import annotations

import time

import pytest

from agent.tasks import Task
from agent.tools import default_registry
from train.expert_data import ExpertTokenServer
from train.rewards import RewardConfig, compose
from train.rollout import RolloutConfig
from train.rollouts import FirstGroups, RLConfig, tasks_for_batch


class Done(ExpertTokenServer):
    def completion(self, messages, tools) -> str:
        return self.completion_text(messages, tools, {"content": "Done."})


def test_a_slow_group_does_not_hold_the_step_and_is_trained_later(tiny, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_text("x = 1\n")
    ids = [f"t{i}" for i in range(6)]
    slow = tasks_for_batch([Task(i, i, "true", workspace=str(ws)) for i in ids], 0, 2, seed=0)[0].id
    tasks = [Task(i, f"look at a.py ({i})", "sleep 6; true" if i == slow else "true", workspace=str(ws), max_turns=2)
             for i in ids]
    cfg = RLConfig(steps=4, group_size=2, groups_per_step=2, workers=4, max_staleness=2, overprovision=1)
    with Done(tiny, tasks) as srv:
        ro = FirstGroups(tasks, cfg, RolloutConfig(srv.base_url, srv.name, max_output_tokens=64, sandbox=False),
                         compose(RewardConfig()), tmp_path / "run", 0, 0, default_registry().spec_hash())
        try:
            seen, waits = [], []
            for k in range(4):
                t0 = time.monotonic()
                eps, _ = ro.batch(k)
                waits.append(time.monotonic() - t0)
                seen.append(({e.task_id for e in eps}, dict(ro.last_counts)))
                assert max(k - e.min_version for e in eps) <= 2  # never past the staleness bound
                assert len(eps) == 4 and all(e.samples and not e.infra_error for e in eps)
                if k < 3:  # the trainer's step: meanwhile the slow group goes on (after the last batch, nothing)
                    time.sleep(3.5)
                srv.version = k + 1
                ro.set_version(k + 1)
        finally:
            ro.close()
    assert slow not in seen[0][0] and waits[0] < 5, (slow, seen, waits)  # step 0 did not wait for the 6 s group
    later = next(i for i, (tasks_k, _) in enumerate(seen) if slow in tasks_k)
    assert later >= 1 and seen[later][1]["groups_carried"] >= 1  # trained at a later step, as a carried group


def test_overprovision_is_checked():
    with pytest.raises(ValueError, match="overprovision must be >= 0"):
        RLConfig(overprovision=-1)
    with pytest.raises(ValueError, match="threads backend"):
        RLConfig(overprovision=1, backend="ray")
