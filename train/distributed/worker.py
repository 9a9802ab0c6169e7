"""The rollout worker side, one code path for every backend: `run_job` runs one episode; a spawned
process (`ProcessBackend`) or a Ray actor (`RayBackend`) loops over its inbox and pushes finished
episodes into one bounded results queue (a full queue blocks the worker: back-pressure).

Light on purpose (no torch): every worker process imports this module.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent.tasks import Task
from train.rewards import RewardConfig, compose
from train.rollout import Episode, RolloutConfig, run_episode

BACKENDS = ("threads", "processes", "ray")


@dataclass
class Job:
    batch: int
    group: int
    index: int
    task: Task
    attempt: int = 0
    queued_at: float = field(default_factory=time.time)

    @property
    def key(self) -> str:
        return f"{self.batch}-{self.group}-{self.index}"


@dataclass
class WorkerSpec:
    """What every worker needs, sent once when it starts (picklable)."""

    rollout: RolloutConfig
    reward: RewardConfig
    out: str
    spec_hash: str
    cpus: float = 1.0


def run_job(spec: WorkerSpec, job: Job, base_url: str, reward_fn=None) -> Episode:
    """One episode of `job` against `base_url`: the same code in a thread, a process or an actor."""
    cfg = replace(spec.rollout, base_url=base_url)
    keep = Path(spec.out) / "trajectories" / f"batch-{job.batch}"
    return run_episode(
        job.task, job.group, cfg, reward_fn or compose(spec.reward), keep_dir=keep, spec_hash=spec.spec_hash,
        variation_key=f"{job.task.id}/{job.key}",
    )


def _result(worker: int, job: Job, ep: Episode, started: float) -> tuple:
    return (
        worker,
        job.key,
        ep,
        {
            "task_wait_s": started - job.queued_at,
            "episode_s": time.time() - started,
            "finished_at": time.time(),
        },
    )


def _process_main(worker: int, spec: WorkerSpec, inbox, results) -> None:
    reward_fn = compose(spec.reward)
    while (item := inbox.get()) is not None:
        job, url = item
        started = time.time()
        results.put(_result(worker, job, run_job(spec, job, url, reward_fn), started))  # blocks when full


class ProcessBackend:
    def __init__(self, spec: WorkerSpec, max_buffered: int, workers: int):
        self.spec = spec
        self.ctx = mp.get_context("spawn")  # the trainer's process has torch threads: never fork it
        self.results = self.ctx.Queue(max_buffered)
        self.procs: dict[int, Any] = {}
        self.inboxes: dict[int, Any] = {}

    def start(self, worker: int) -> None:
        self.inboxes[worker] = self.ctx.Queue()
        p = self.ctx.Process(
            target=_process_main,
            args=(worker, self.spec, self.inboxes[worker], self.results),
            daemon=True,
            name=f"rollout-{worker}",
        )
        p.start()
        self.procs[worker] = p

    def send(self, worker: int, job: Job, url: str) -> None:
        self.inboxes[worker].put((job, url))

    def get(self, timeout: float):
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            return None

    def dead(self) -> list[int]:
        return [w for w, p in self.procs.items() if not p.is_alive()]

    def kill(self, worker: int) -> None:
        self.procs[worker].kill()

    def close(self) -> None:
        for w, p in self.procs.items():
            if p.is_alive():
                self.inboxes[w].put(None)
        for p in self.procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()


class RayWorker:
    """A rollout worker as a Ray actor; `run` pushes the episode to the shared queue and returns its key
    (the driver watches that reference to learn that the actor died)."""

    def __init__(self, worker: int, spec: WorkerSpec, results):
        self.worker, self.spec, self.results = worker, spec, results
        self.reward_fn = compose(spec.reward)

    def run(self, job: Job, url: str) -> str:
        started = time.time()
        self.results.put(_result(self.worker, job, run_job(self.spec, job, url, self.reward_fn), started))
        return job.key


class RayBackend:
    def __init__(self, spec: WorkerSpec, max_buffered: int, workers: int):
        try:
            import ray
            from ray.util.queue import Queue
        except ImportError as e:
            raise RuntimeError("the ray backend needs Ray: pip install 'composer[ray]'") from e
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)  # RAY_ADDRESS joins a running cluster
        self.ray, self.spec = ray, spec
        self.results = Queue(maxsize=max_buffered, actor_options={"num_cpus": 0})
        cpus = spec.cpus
        total = ray.cluster_resources().get("CPU", 0)
        if workers * cpus > total > 0:  # actors that cannot be placed would wait forever: share the CPUs
            cpus = total / workers
            print(
                f"rollouts: {workers} Ray actors x {spec.cpus} CPU > the cluster's {total:g} CPUs; "
                f"each actor asks for {cpus:.2f}",
                file=sys.stderr,
            )
        self.cls = ray.remote(num_cpus=cpus, max_restarts=0)(RayWorker)
        self.actors: dict[int, Any] = {}
        self.acks: dict[int, Any] = {}

    def start(self, worker: int) -> None:
        self.actors[worker] = self.cls.remote(worker, self.spec, self.results)
        self.acks.pop(worker, None)

    def send(self, worker: int, job: Job, url: str) -> None:
        self.acks[worker] = self.actors[worker].run.remote(job, url)

    def get(self, timeout: float):
        from ray.util.queue import Empty

        try:
            return self.results.get(timeout=timeout)
        except Empty:
            return None

    def dead(self) -> list[int]:
        out = []
        refs = {ref: w for w, ref in self.acks.items()}
        if not refs:
            return out
        ready, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            w = refs[ref]
            del self.acks[w]
            try:
                self.ray.get(ref)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.WorkerCrashedError):
                out.append(w)
        return out

    def kill(self, worker: int) -> None:
        self.ray.kill(self.actors[worker], no_restart=True)

    def close(self) -> None:
        for a in self.actors.values():
            self.ray.kill(a, no_restart=True)
        self.ray.kill(self.results.actor, no_restart=True)
