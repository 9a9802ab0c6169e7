"""One RL episode through the deployed harness: the real Agent, registry, tools, system prompt and
context handling (agent.runtime.build, exactly what `composer-agent --task` runs), against an
OpenAI-compatible endpoint with token recording on. The session JSONL it writes is the training data.

The task's workspace is a fresh copy; the verify command runs afterwards (it was never in the
workspace). An episode the harness could not finish through no fault of the model (server errors,
an exception in the harness, a verify command that could not start) is marked `infra_error`: it is
masked out of training, never scored 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.config import Config
from agent.tasks import Task, runner
from agent.tasks.variation import draw
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
    sandbox: bool | None = None
    """Shell commands under bubblewrap (default: when it is installed)."""
    vary_environment: bool = False
    """Each episode in another folder shape, git state and date (agent/tasks/variation.py), drawn from
    its `variation_key`: what the tiny recipe's SFT data had, so RL does not narrow the model back to one
    workspace."""


def run_episode(task: Task, group: int, cfg: RolloutConfig, reward_fn=None, *, keep_dir: Path | None = None,
                spec_hash: str | None = None, variation_key: str | None = None) -> Episode:
    """Run `task` once through agent.tasks.runner (the session file is copied into `keep_dir`). With
    cfg.vary_environment, `variation_key` (default: the task and group) picks the environment."""
    reward_fn = reward_fn or compose_default()
    config = Config(base_url=cfg.base_url, model=cfg.model, api_key=cfg.api_key, temperature=cfg.temperature,
                    max_output_tokens=cfg.max_output_tokens, record_tokens=True, context_window=cfg.context_window,
                    request_timeout_s=cfg.request_timeout_s, max_retries=2)
    variation = draw(variation_key or f"{task.id}/{group}") if cfg.vary_environment else None
    res = runner.run_episode(task, config, keep_dir=keep_dir, label=str(group), sandbox=cfg.sandbox,
                             variation=variation)
    ep = Episode(task.id, group, res.status, passed=res.passed, infra_error=res.infra_error,
                 session_path=res.session_path, duration_s=res.duration_s, verify_s=res.verify_s)
    data = res.session
    if ep.infra_error or data is None:
        ep.infra_error = ep.infra_error or "no session was recorded"
        return ep
    try:
        ep.samples = build_samples(data, spec_hash=spec_hash)
    except TrajectoryError as e:
        ep.infra_error = str(e)
        return ep
    ep.stats = episode_stats(data, ep.passed)
    ep.reward, ep.components = reward_fn(ep.stats, task.as_dict())
    return ep


def compose_default():
    from train.rewards import RewardConfig

    return compose(RewardConfig())


def describe(ep: Episode) -> dict[str, Any]:
    """One line of the run's episodes.jsonl."""
    return {"task": ep.task_id, "group": ep.group, "status": ep.status, "passed": ep.passed, "reward": ep.reward,
            "components": ep.components, "infra_error": ep.infra_error, "samples": len(ep.samples),
            "completion_tokens": ep.completion_tokens, "min_version": ep.min_version,
            "session": ep.session_path, "turns": ep.stats.turns if ep.stats else None,
            "tool_calls": ep.stats.tool_calls if ep.stats else None,
            "claims": ep.stats.claims if ep.stats else None,
            "unsupported_claims": ep.stats.unsupported_claims if ep.stats else None,
            "contradicted_claims": ep.stats.contradicted_claims if ep.stats else None, "duration_s": round(ep.duration_s, 3), "verify_s": round(ep.verify_s, 3)}
