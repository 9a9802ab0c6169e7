"""An RL run's configuration and its batches of episodes: `RLConfig`, the tasks of each batch, and
`Rollouts`, worker threads that run episodes through the real harness as the staleness gate releases
each batch (train/rl.py drives it; train/distributed/rollouts.py runs the same batches on a process
pool or Ray). Its own module, so that the run and the distributed rollouts import it and not each other.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.tasks import Task
from train.rollout import Episode, RolloutConfig, run_episode


@dataclass
class RLConfig:
    steps: int = 10
    """Optimizer steps."""
    group_size: int = 4
    """Episodes per task per step (the group of group-relative advantages)."""
    groups_per_step: int = 2
    """Tasks per step."""
    max_staleness: int = 1
    """Use an episode at step s only if s - its policy version <= this (0 = synchronous)."""
    workers: int = 4
    """Episodes run at once."""
    seed: int = 0
    """Task order and trainer initialisation."""
    save_every: int = 5
    """Write a resumable checkpoint every this many steps (and at the end)."""
    temperature: float = 1.0
    max_output_tokens: int = 256
    """max_tokens of each model request."""
    server_args: list[str] = field(default_factory=list)
    """Extra composer-serve flags when the run launches its own server (which always gets the trainer's
    --dtype, and --batch-invariant when the trainer has it: it serves what the trainer computes)."""
    vary_environment: bool = False
    """Each episode in another folder shape, git state and date (train/rollout.py)."""
    backend: str = "threads"
    """Where episodes run: threads (this process), processes (a local pool) or ray (actors on a Ray
    cluster); see train/distributed/rollouts.py."""
    shuffle_rewards: bool = False
    """A control run: each usable episode of a step is trained with the reward of another episode of
    that step (a permutation drawn from seed and step). Advantages keep their size and spread, and the
    optimizer moves as far, but they say nothing about the episode they push on. Metrics keep the true
    rewards."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.group_size < 1 or self.groups_per_step < 1 or self.workers < 1:
            raise ValueError("steps, group_size, groups_per_step and workers must be at least 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if self.backend not in ("threads", "processes", "ray"):
            raise ValueError(f"backend must be threads, processes or ray, not {self.backend!r}")


def tasks_for_batch(tasks: list[Task], k: int, n: int, seed: int) -> list[Task]:
    """The tasks of batch k: epochs of a seeded shuffle, read n at a time (a function of k alone)."""
    out = []
    for j in range(k * n, (k + 1) * n):
        epoch, i = divmod(j, len(tasks))
        order = list(range(len(tasks)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(tasks[order[i]])
    return out


class Rollouts:
    """Worker threads running episodes; batches released by the staleness gate."""

    error: BaseException | None = None  # set when what produces the episodes stopped (train/distributed)

    def __init__(self, tasks: list[Task], cfg: RLConfig, rollout: RolloutConfig, reward_fn, out: Path,
                 first_batch: int, version: int, spec_hash: str):
        self.tasks, self.cfg, self.rollout, self.reward_fn, self.out = tasks, cfg, rollout, reward_fn, out
        self.spec_hash = spec_hash
        self.version = version
        # Versions go up one a step from the start checkpoint's own (0 after SFT, 25 for a model RL made):
        # batch k is sampled by version base + k - staleness or later
        self.base = version - first_batch
        self.cond = threading.Condition()
        self.done: dict[int, list[Episode]] = {}
        self.started: dict[int, float] = {}
        self.finished_at: dict[int, float] = {}
        self.jobs: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._dispatch, args=(first_batch,), daemon=True, name="dispatch")]
        self.threads += [threading.Thread(target=self._work, daemon=True, name=f"rollout-{i}") for i in range(cfg.workers)]
        for t in self.threads:
            t.start()

    def set_version(self, v: int) -> None:
        with self.cond:
            self.version = v
            self.cond.notify_all()

    def _dispatch(self, k: int) -> None:
        while not self.stop.is_set() and k < self.cfg.steps:
            with self.cond:
                while self.version - self.base < k - self.cfg.max_staleness and not self.stop.is_set():
                    self.cond.wait(0.5)
                self.started[k] = time.monotonic()
            for g, task in enumerate(tasks_for_batch(self.tasks, k, self.cfg.groups_per_step, self.cfg.seed)):
                for i in range(self.cfg.group_size):
                    self.jobs.put((k, g, i, task))
            k += 1

    def _work(self) -> None:
        while not self.stop.is_set():
            try:
                k, g, i, task = self.jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            ep = run_episode(task, g, self.rollout, self.reward_fn, keep_dir=self.out / "trajectories" / f"batch-{k}",
                             spec_hash=self.spec_hash, variation_key=f"{task.id}/{k}-{g}-{i}")  # as train/distributed/worker.py
            self._add(k, ep)

    def _add(self, k: int, ep: Episode) -> None:
        """A finished episode of batch k; the batch's last one stamps its end."""
        with self.cond:
            self.done.setdefault(k, []).append(ep)
            if len(self.done[k]) == self.cfg.group_size * self.cfg.groups_per_step:
                self.finished_at[k] = time.monotonic()
            self.cond.notify_all()

    def batch(self, k: int) -> tuple[list[Episode], float]:
        """Batch k's episodes once all have finished, and its rollout wall time."""
        want = self.cfg.group_size * self.cfg.groups_per_step
        with self.cond:
            while len(self.done.get(k, [])) < want:
                if self.error is not None:
                    raise RuntimeError(f"the rollout driver stopped: {self.error!r}") from self.error
                self.cond.wait(0.5)
            return self.done.pop(k), self.finished_at[k] - self.started[k]

    def close(self) -> None:
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
