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
    overprovision: int = 0
    """Groups kept in flight beyond groups_per_step (threads backend; `FirstGroups`): a step trains on
    the first groups_per_step groups to finish instead of waiting for its slowest episode; the others are
    carried to the next step, and dropped there if older than max_staleness allows (then replaced)."""
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
        if self.overprovision < 0:
            raise ValueError("overprovision must be >= 0")
        if self.overprovision and self.backend != "threads":
            raise ValueError("overprovision needs the threads backend (train/rollouts.py FirstGroups)")


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
            self._add(self._key(k, g), ep)

    @staticmethod
    def _key(batch: int, group: int) -> int:
        """What a finished episode is filed under: its batch here, its group in FirstGroups."""
        return batch

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


class FirstGroups(Rollouts):
    """Rollouts that do not wait on stragglers: groups_per_step + cfg.overprovision groups are kept in
    flight, and a step's batch is the first groups_per_step groups to finish among those released for
    it or before (groups released earlier first). A slow group is not lost, it is trained on at a later step (carried), unless by then
    it is older than max_staleness allows: then it is dropped and a new group replaces it. Its episodes
    are still counted in last_counts, so a bias towards fast tasks shows."""

    def __init__(self, tasks: list[Task], cfg: RLConfig, rollout: RolloutConfig, reward_fn, out: Path,
                 first_batch: int, version: int, spec_hash: str):
        self.tasks, self.cfg, self.rollout, self.reward_fn, self.out = tasks, cfg, rollout, reward_fn, out
        self.spec_hash = spec_hash
        self.version = version
        # Versions go up one a step from the start checkpoint's own (0 after SFT, 25 for a model RL made):
        # batch k is sampled by version base + k - staleness or later
        self.base = version - first_batch
        self.cond = threading.Condition()
        # Groups are numbered in dispatch order; group j's task is position j of the task stream (the
        # tasks tasks_for_batch gives, read on), so the tasks are a function of the seed alone.
        self.next_group = first_batch * cfg.groups_per_step
        self.released: dict[int, int] = {}  # group -> the batch it was released for
        self.episodes: dict[int, list[Episode]] = {}
        self.ready: list[int] = []  # complete groups, in the order they finished
        self.outstanding = 0  # groups dispatched and neither trained on nor dropped
        self.consumed = first_batch  # batches handed to the trainer
        self.started: dict[int, float] = {}
        self.last_counts: dict[str, int] = {}
        self.jobs: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._dispatch, args=(first_batch,), daemon=True, name="dispatch")]
        self.threads += [threading.Thread(target=self._work, daemon=True, name=f"rollout-{i}") for i in range(cfg.workers)]
        for t in self.threads:
            t.start()

    def task_of(self, group: int) -> Task:
        g = self.cfg.groups_per_step
        return tasks_for_batch(self.tasks, group // g, g, self.cfg.seed)[group % g]

    def _release(self, k: int, n: int) -> None:
        """Dispatch n more groups for batch k (caller holds the lock)."""
        for _ in range(n):
            j, self.next_group = self.next_group, self.next_group + 1
            self.released[j] = k
            self.outstanding += 1
            task = self.task_of(j)
            for i in range(self.cfg.group_size):
                self.jobs.put((k, j, i, task))

    def _dispatch(self, k: int) -> None:
        while not self.stop.is_set() and k < self.cfg.steps:
            with self.cond:
                while self.version - self.base < k - self.cfg.max_staleness and not self.stop.is_set():
                    self.cond.wait(0.5)
                self.started[k] = time.monotonic()
                # in flight: groups_per_step for each batch released and not yet trained on (two when the next
                # batch samples during a step), plus the overprovision
                target = self.cfg.groups_per_step * (k - self.consumed + 1) + self.cfg.overprovision
                self._release(k, max(0, target - self.outstanding))
            k += 1

    @staticmethod
    def _key(batch: int, group: int) -> int:
        return group

    def _add(self, group: int, ep: Episode) -> None:
        with self.cond:
            self.episodes.setdefault(group, []).append(ep)
            if len(self.episodes[group]) == self.cfg.group_size:
                self.ready.append(group)
            self.cond.notify_all()

    def _too_stale(self, group: int) -> bool:
        eps = [e for e in self.episodes[group] if not e.infra_error and e.samples]
        return bool(eps) and self.version - min(e.min_version for e in eps) > self.cfg.max_staleness

    def batch(self, k: int) -> tuple[list[Episode], float]:
        """The first groups_per_step groups released for batches <= k to finish, and the wall time from
        batch k's release to the last of them. self.last_counts: groups carried from an earlier batch,
        and groups dropped as too stale (replaced by new ones)."""
        want = self.cfg.groups_per_step
        carried = dropped = 0
        taken: list[int] = []
        with self.cond:
            while len(taken) < want:
                if self.error is not None:
                    raise RuntimeError(f"the rollout driver stopped: {self.error!r}") from self.error
                mine = [g for g in self.ready if self.released[g] <= k]
                if not mine:
                    self.cond.wait(0.5)
                    continue
                # carried groups first (the oldest release), so a slow task is trained on as soon as it is done
                g = min(mine, key=lambda j: self.released[j])
                self.ready.remove(g)
                self.outstanding -= 1
                # (a bounded number: a server that does not report the new version would make every
                # replacement stale too; past the bound advantages_for drops and counts them instead)
                if dropped < want + self.cfg.overprovision and self._too_stale(g):
                    dropped += 1
                    del self.episodes[g]
                    self._release(k, 1)
                    continue
                carried += self.released[g] < k
                taken.append(g)
            rollout_s = time.monotonic() - self.started[k]
            self.last_counts = {"groups_carried": carried, "groups_dropped_stale": dropped}
            self.consumed = k + 1
            return [ep for g in taken for ep in self.episodes.pop(g)], rollout_s
