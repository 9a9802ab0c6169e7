"""Rollout workers on a local Ray cluster (and on the local process pool, the same code): an RL step end
to end with 2 actors against a scripted token server (the expert token server answering "Done." after
a pause: short episodes, long enough to be killed in the middle), and a worker killed mid-episode
that loses no finished trajectory and fails nothing."""

from __future__ import annotations

import json
import time

import pytest

from agent.tasks import Task
from agent.tools import default_registry
from train.distributed.rollouts import DistributedRollouts
from train.expert_data import ExpertTokenServer
from train.progress import Progress
from train.rewards import RewardConfig
from train.rl import RLConfig, run
from train.rollout import RolloutConfig
from train.server import ServerError
from train.trainer import TrainerConfig

ray = pytest.importorskip("ray")


class SyncedExpert(ExpertTokenServer):
    """Answers every turn with "Done." after `delay_s`, in the model's own chat format with token ids,
    and serves the load-from-disk endpoint (recording the versions it was given)."""

    def __init__(self, model_dir, delay_s: float = 0.0):
        super().__init__(model_dir, [])
        self.delay_s, self.loaded = delay_s, []

    def completion(self, messages, tools) -> str:
        time.sleep(self.delay_s)
        return self.completion_text(messages, tools, {"content": "Done."})

    def _handler(self):
        server, base = self, super()._handler()

        class Handler(base):
            def do_POST(self) -> None:
                if self.path.rstrip("/").endswith("/load_weights"):
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                    server.version = int(body["policy_version"])
                    server.loaded.append((body["path"], server.version))
                    self._send(
                        200, json.dumps({"policy_version": server.version}).encode(), "application/json"
                    )
                    return
                super().do_POST()

        return Handler


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def tasks(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_text("x = 1\n")
    return [Task(f"t{i}", f"look at a.py ({i})", "true", workspace=str(ws), max_turns=2) for i in range(2)]


@pytest.mark.slow
def test_rl_step_end_to_end_with_two_ray_actors(tiny, tmp_path, ray_cluster, tasks):
    with SyncedExpert(tiny) as srv:
        cfg = RLConfig(steps=1, group_size=2, groups_per_step=2, workers=2, max_staleness=0, backend="ray")
        hist = run(
            tiny,
            tasks,
            tmp_path / "run",
            cfg,
            trainer_cfg=TrainerConfig(lr=1e-3, mxfp8_experts=False),
            base_url=srv.base_url,
            served_name=srv.name,
            progress=Progress(1, out=open("/dev/null", "w")),  # noqa: SIM115
        )
        assert srv.loaded and srv.loaded[-1][1] == 1  # the new weights went to the server after the step
    m = hist[0]
    assert (
        m["episodes"] == 4 and m["infra_masked"] == 0 and m["pass_rate"] == 1.0 and m["groups_skipped"] == 0
    )
    assert m["train_tokens"] > 0 and m["policy_version"] == 0
    assert len(list((tmp_path / "run" / "trajectories" / "batch-0").glob("*.jsonl"))) == 4


def rollouts(tasks, out, srv, backend, workers=2, episodes=6):
    cfg = RLConfig(steps=1, group_size=episodes // 2, groups_per_step=2, workers=workers, max_staleness=0)
    rollout = RolloutConfig(srv.base_url, srv.name, max_output_tokens=64, sandbox=False)
    return DistributedRollouts(
        tasks,
        cfg,
        rollout,
        RewardConfig(),
        out,
        0,
        0,
        default_registry().spec_hash(),
        backend=backend,
        cpus_per_worker=0.5,
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ray", "processes"])
def test_killed_worker_loses_no_finished_episode(tiny, tmp_path, backend, request, tasks):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    with SyncedExpert(tiny, delay_s=2.0) as srv:
        ro = rollouts(tasks, tmp_path / "out", srv, backend)
        try:
            deadline = time.monotonic() + 60
            while not ro.done.get(0) and time.monotonic() < deadline:  # at least one episode finished
                time.sleep(0.05)
            time.sleep(0.3)  # the worker that finished took the next episode: it is waiting on its 2 s answer
            finished = [ep.session_path for ep in ro.done[0]]
            victim, (job, _) = max(ro.assigned.items(), key=lambda kv: kv[1][0].queued_at)
            ro.backend.kill(victim)
            episodes, _ = ro.batch(0)
        finally:
            ro.close()
    assert len(episodes) == 6
    assert all(ep.infra_error is None and ep.passed for ep in episodes), [ep.infra_error for ep in episodes]
    assert set(finished) <= {ep.session_path for ep in episodes}
    assert ro.stats["workers_replaced"] == 1 and ro.stats["retried"] == 1 and ro.stats["masked"] == 0, (
        ro.stats
    )
    assert job.key in ro.recorded and len(ro.timings) == 6 and all(t["episode_s"] > 0 for t in ro.timings)


def test_endpoint_pool_is_sticky_and_least_loaded():
    from train.distributed.pool import EndpointPool

    pool = EndpointPool(["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"])
    a, b = (e.base_url for e in pool.endpoints)
    assert pool.acquire("ep1") == a and pool.acquire("ep2") == b and pool.acquire("ep3") == a
    assert pool.acquire("ep2") == b  # every turn of an episode goes to its server
    pool.release("ep1")
    pool.release("ep3")
    assert pool.acquire("ep4") == a  # a has no episode left, b has one
    assert pool.check(timeout=0.5) == [a, b]  # nothing listens there: both leave the pool
    with pytest.raises(ServerError, match="no healthy inference endpoint"):
        pool.acquire("ep5")


@pytest.mark.slow
def test_dead_server_episodes_are_retried_on_another(tiny, tmp_path, tasks):
    with SyncedExpert(tiny, delay_s=0.3) as one, SyncedExpert(tiny, delay_s=0.3) as two:
        cfg = RLConfig(steps=1, group_size=3, groups_per_step=2, workers=2, max_staleness=0)
        rollout = RolloutConfig(one.base_url, one.name, max_output_tokens=64, sandbox=False)
        ro = DistributedRollouts(
            tasks,
            cfg,
            rollout,
            RewardConfig(),
            tmp_path / "out",
            0,
            0,
            default_registry().spec_hash(),
            backend="processes",
            endpoints=[one.base_url, two.base_url],
        )
        try:
            deadline = time.monotonic() + 60
            while not ro.done.get(0) and time.monotonic() < deadline:
                time.sleep(0.05)
            one.httpd.shutdown()  # the first server goes away: new requests to it are refused
            one.httpd.server_close()
            episodes, _ = ro.batch(0)
        finally:
            ro.close()
    assert len(episodes) == 6 and all(ep.passed and not ep.infra_error for ep in episodes), [
        (ep.status, ep.infra_error) for ep in episodes
    ]
    assert ro.stats["retried"] >= 1 and ro.stats["masked"] == 0, ro.stats
    assert [e.healthy for e in ro.pool.endpoints] == [False, True]
