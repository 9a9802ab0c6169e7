"""One RL episode through the deployed harness: the real Agent, registry, tools, system prompt and
context handling (agent.runtime.build, exactly what `composer-agent --task` runs), against an
OpenAI-compatible endpoint with token recording on. The session JSONL it writes is the training data.

The task's workspace is a fresh copy; the verify command runs afterwards (it was never in the
workspace). An episode the harness could not finish through no fault of the model (server errors,
an exception in the harness, a verify command that could not start) is marked `infra_error`: it is
masked out of training, never scored 0.
"""

from __future__ import annotations

import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.approval import Approvals
from agent.config import Config
from agent.runtime import build
from agent.session import load
from agent.tasks import Task, Workspace, verify
from train.rewards import EpisodeStats, compose, episode_stats
from train.samples import Sample, TrajectoryError, build_samples


@dataclass
class Episode:
    task_id: str
    group: int  # episodes of one group are rollouts of the same task at the same step
    status: str
    passed: bool = False
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    stats: EpisodeStats | None = None
    infra_error: str | None = None
    session_path: str | None = None
    duration_s: float = 0.0
    verify_s: float = 0.0

    @property
    def min_version(self) -> int:
        return min((s.min_version for s in self.samples), default=0)

    @property
    def completion_tokens(self) -> int:
        return sum(s.sampled_tokens for s in self.samples)


@dataclass
class RolloutConfig:
    base_url: str
    """The inference server's /v1 URL."""
    model: str
    """Model name on that server."""
    api_key: str | None = None
    temperature: float = 1.0
    """Sampling temperature of every request."""
    max_output_tokens: int = 512
    """max_tokens of every request."""
    context_window: int | None = None
    """Context window the agent budgets for (default: the server's)."""
    request_timeout_s: float = 600.0


def run_episode(task: Task, group: int, cfg: RolloutConfig, reward_fn=None, *, keep_dir: Path | None = None,
                spec_hash: str | None = None) -> Episode:
    """Run `task` once; the session file is copied into `keep_dir` if given."""
    reward_fn = reward_fn or compose_default()
    start = time.monotonic()
    ws = Workspace.create(task)
    try:
        config = Config(base_url=cfg.base_url, model=cfg.model, api_key=cfg.api_key, temperature=cfg.temperature,
                        max_output_tokens=cfg.max_output_tokens, record_tokens=True, max_turns=task.max_turns,
                        max_time_s=task.max_time_s, token_budget=task.token_budget, approval="auto",
                        context_window=cfg.context_window, request_timeout_s=cfg.request_timeout_s, max_retries=2)
        try:
            rt = build(config, ws.root, emit=lambda e: None, approve=Approvals("auto"))
            finished = rt.agent.run(task.prompt, rt.system)
            rt.session.close()
        except Exception as e:  # noqa: BLE001 - the harness failed, not the model: mask the episode
            return Episode(task.id, group, "error", infra_error=f"{type(e).__name__}: {e}",
                           duration_s=time.monotonic() - start)
        session_path = Path(rt.session.path)
        if keep_dir is not None:
            keep_dir.mkdir(parents=True, exist_ok=True)
            session_path = Path(shutil.copy(session_path, keep_dir / f"{task.id}-{group}-{rt.session.id}.jsonl"))
        ep = Episode(task.id, group, finished.status, session_path=str(session_path))
        if finished.status == "error" or finished.status == "interrupted":
            ep.infra_error = finished.error or finished.status
            ep.duration_s = time.monotonic() - start
            return ep
        t0 = time.monotonic()
        ep.passed, _ = verify(task, ws.root)
        ep.verify_s = time.monotonic() - t0
        data = load(session_path)
        try:
            ep.samples = build_samples(data, spec_hash=spec_hash)
        except TrajectoryError as e:
            ep.infra_error = str(e)
        ep.stats = episode_stats(data, ep.passed)
        ep.reward, ep.components = reward_fn(ep.stats, task.as_dict())
        ep.duration_s = time.monotonic() - start
        return ep
    except Exception:  # noqa: BLE001 - never let one episode take the run down
        return Episode(task.id, group, "error", infra_error=traceback.format_exc(limit=3),
                       duration_s=time.monotonic() - start)
    finally:
        ws.cleanup()


def compose_default():
    from train.rewards import RewardConfig

    return compose(RewardConfig())


def describe(ep: Episode) -> dict[str, Any]:
    """One line of the run's episodes.jsonl."""
    return {"task": ep.task_id, "group": ep.group, "status": ep.status, "passed": ep.passed, "reward": ep.reward,
            "components": ep.components, "infra_error": ep.infra_error, "samples": len(ep.samples),
            "completion_tokens": ep.completion_tokens, "min_version": ep.min_version,
            "session": ep.session_path, "duration_s": round(ep.duration_s, 3), "verify_s": round(ep.verify_s, 3)}
