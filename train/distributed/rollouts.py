"""Rollouts on many processes or a Ray cluster, behind the interface of `train.rollouts.Rollouts`.

A driver thread (in the trainer's process) hands each episode to an idle rollout worker together with
the inference endpoint it must use (least-loaded, sticky for the whole episode: `pool.EndpointPool`).
A worker owns its workspaces: it creates, runs, verifies and deletes them itself (agent.tasks.runner),
then pushes the finished Episode (token-exact samples, reward) into one bounded results queue: when
the driver falls behind, workers block on the put instead of piling trajectories up in memory, and
the staleness gate of `train.rl` bounds how many batches are in flight at all.

Two backends, one worker code path (`run_job`):
  - "processes": `multiprocessing` (spawn) processes, one inbox queue each, on this machine;
  - "ray": Ray actors (`pip install 'composer[ray]'`), results through `ray.util.queue.Queue`; joins
    the cluster in RAY_ADDRESS, or starts a local one.

Failures: a worker that dies (killed, OOM, its node lost) is replaced and the episode it was running
is retried from scratch on another worker; an episode that comes back with an infrastructure error
(its server died mid-episode, ...) is retried after a health check of the endpoints. After
`max_retries` the episode stays marked `infra_error`, which training masks: a dead machine is never
scored as a failure of the model. A finished episode is recorded once (by key), so a retry racing a
result that was already on its way cannot count twice.

Limits: workers read the task's workspace source and write trajectories under OUT, so on a
multi-node cluster both must be on a shared filesystem (or baked into the image).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

from agent.tasks import Task
from train.distributed.pool import EndpointPool
from train.distributed.worker import Job, ProcessBackend, RayBackend, WorkerSpec
from train.rewards import RewardConfig
from train.rollout import Episode, RolloutConfig
from train.rollouts import RLConfig, Rollouts
from train.server import ServerError


class DistributedRollouts(Rollouts):
    """`train.rollouts.Rollouts` (staleness gate, batches, versions) with the episodes run by a worker pool."""

    def __init__(
        self,
        tasks: list[Task],
        cfg: RLConfig,
        rollout: RolloutConfig,
        reward: RewardConfig,
        out: Path,
        first_batch: int,
        version: int,
        spec_hash: str,
        *,
        backend: str = "processes",
        endpoints: list[str] | None = None,
        max_retries: int = 2,
        max_buffered: int | None = None,
        cpus_per_worker: float = 1.0,
    ):
        if backend not in ("processes", "ray"):
            raise ValueError(f"unknown rollout backend {backend!r}: processes or ray")
        self.tasks, self.cfg, self.rollout, self.out = tasks, cfg, rollout, out
        self.spec_hash, self.version = spec_hash, version
        self.base = version - first_batch  # as in Rollouts: batch k waits for version base + k - staleness
        self.cond = threading.Condition()
        self.done: dict[int, list[Episode]] = {}
        self.started: dict[int, float] = {}
        self.finished_at: dict[int, float] = {}
        self.jobs: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.pool = EndpointPool(endpoints or [rollout.base_url])
        self.max_retries = max_retries
        spec = WorkerSpec(rollout, reward, str(out), spec_hash, cpus_per_worker)
        buffered = max_buffered or 2 * cfg.workers
        self.backend = (RayBackend if backend == "ray" else ProcessBackend)(spec, buffered, cfg.workers)
        self.stats = {"workers_replaced": 0, "retried": 0, "masked": 0, "duplicates": 0}
        self.timings: list[dict[str, float]] = []
        self.assigned: dict[int, tuple[Job, str]] = {}
        self.recorded: set[str] = set()
        self.pending: deque[Job] = deque()
        for w in range(cfg.workers):
            self.backend.start(w)
        self.threads = [
            threading.Thread(target=self._dispatch, args=(first_batch,), daemon=True, name="dispatch"),
            threading.Thread(target=self._schedule, daemon=True, name="schedule"),
        ]
        for t in self.threads:
            t.start()

    # -- the driver loop ---------------------------------------------------------------------------------

    def _schedule(self) -> None:
        try:
            while not self.stop.is_set():
                self._take_jobs()
                while (r := self.backend.get(timeout=0.05 if self.assigned else 0.0)) is not None:
                    self._collect(*r)
                for w in self.backend.dead():
                    self._replace(w)
                self._feed()
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer by batch()
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _take_jobs(self) -> None:
        while True:
            try:
                k, g, i, task = self.jobs.get(timeout=0.05 if not self.assigned and not self.pending else 0)
            except queue.Empty:
                return
            self.pending.append(Job(k, g, i, task))

    def _feed(self) -> None:
        for w in range(self.cfg.workers):
            if w in self.assigned or not self.pending:
                continue
            job = self.pending[0]
            try:
                url = self.pool.acquire(job.key)
            except ServerError:
                if not self.pool.check():  # some endpoint is back
                    continue
                time.sleep(1.0)
                return
            self.pending.popleft()
            self.assigned[w] = (job, url)
            self.backend.send(w, job, url)

    def _collect(self, worker: int, key: str, ep: Episode, timing: dict[str, float]) -> None:
        job, _ = self.assigned.get(worker, (None, None))
        if job is not None and job.key == key:
            del self.assigned[worker]
        self.pool.release(key)
        if key in self.recorded:
            self.stats["duplicates"] += 1
            return
        if ep.infra_error and job is not None and job.attempt < self.max_retries:
            self.pool.check()  # a dead server leaves the pool before the retry picks one
            self._retry(job)
            return
        timing["result_wait_s"] = time.time() - timing.pop("finished_at")
        self.timings.append(timing)
        self._record(int(key.split("-")[0]), key, ep)

    def _replace(self, worker: int) -> None:
        self.stats["workers_replaced"] += 1
        self.backend.start(worker)
        job, _ = self.assigned.pop(worker, (None, None))
        if job is None or job.key in self.recorded:
            return
        self.pool.release(job.key)
        if job.attempt < self.max_retries:
            self._retry(job)
        else:
            self._record(
                job.batch,
                job.key,
                Episode(job.task.id, job.group, "error", infra_error=f"rollout worker {worker} died"),
            )

    def _retry(self, job: Job) -> None:
        self.stats["retried"] += 1
        self.pending.appendleft(replace(job, attempt=job.attempt + 1, queued_at=time.time()))

    def _record(self, k: int, key: str, ep: Episode) -> None:
        self.recorded.add(key)
        self.stats["masked"] += bool(ep.infra_error)
        self._add(k, ep)

    # -- the trainer's side --------------------------------------------------------------------------------

    def close(self) -> None:
        super().close()
        for t in self.threads:
            t.join(5)
        self.backend.close()
