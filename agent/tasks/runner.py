"""One episode of a task through the normal agent loop (what `composer-agent --task` runs), verified.

Shared by `composer-agent eval` and by RL rollouts (train/rollout.py adds token-exact samples and
rewards on top). The shell runs under bubblewrap when it is installed (no network, writes only in the
workspace) unless told otherwise. An episode the harness could not finish through no fault of the
model (a server error, an exception in the harness) has `infra_error` set: evaluation reports it
apart and training masks it, neither scores it as a failure.
"""

from __future__ import annotations

import shutil
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent.approval import Approvals
from agent.config import Config
from agent.protocol import POLICY_ERRORS
from agent.runtime import build
from agent.session import SessionData, load
from agent.tasks.quality import Baseline, measure
from agent.tasks.spec import Task
from agent.tasks.variation import Variation
from agent.tasks.workspace import Workspace


@dataclass
class EpisodeResult:
    task_id: str
    status: str
    passed: bool = False
    final_text: str = ""
    infra_error: str | None = None
    session_path: str | None = None
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: int = 0
    turns_with_calls: int = 0
    duration_s: float = 0.0
    verify_s: float = 0.0
    verify_output: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    session: SessionData | None = field(default=None, repr=False)  # the recorded trajectory, read once

    @property
    def tool_calls_per_turn(self) -> float:
        return self.tool_calls / self.turns_with_calls if self.turns_with_calls else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("task_id", "status", "passed", "infra_error", "session_path", "turns",
                                           "prompt_tokens", "completion_tokens", "tool_calls", "duration_s",
                                           "verify_s")}
        return d | {"tool_calls_per_turn": round(self.tool_calls_per_turn, 3), **self.extra}


def sandbox_available() -> bool:
    return shutil.which("bwrap") is not None


def episode_config(base: Config, task: Task, sandbox: bool | None = None) -> Config:
    """The run's configuration with the task's limits (and the sandbox where it can be had). Episodes use
    Composer's own tools only: a user's MCP servers would change the spec hash training expects (and be
    started again for every fresh workspace)."""
    return replace(base, max_turns=task.max_turns, max_time_s=task.max_time_s, token_budget=task.token_budget,
                   approval="auto", sandbox=sandbox_available() if sandbox is None else sandbox, mcp_servers={})


def run_episode(task: Task, config: Config, *, keep_dir: Path | None = None, label: str = "",
                sandbox: bool | None = None, variation: Variation | None = None,
                quality: bool = False) -> EpisodeResult:
    """Run `task` once in a fresh workspace; the session file is copied into `keep_dir` if given and
    read back once into `result.session` (what training builds its samples from). A `variation` (training
    data) sets the workspace's folder and git state and the date the system prompt names. With `quality`
    (eval), `extra["quality"]` holds agent.tasks.quality's figures, and an episode that edited tests or
    the verifier's files does not pass whatever the verifier says (`extra["fail_reason"]` says so)."""
    start = time.monotonic()
    ws: Workspace | None = None
    try:
        ws = Workspace.create(task, variation=variation)
        baseline = Baseline.take(ws.root, ws.home) if quality else None
        cfg = episode_config(config, task, sandbox)
        try:
            rt = build(cfg, ws.root, emit=lambda e: None, approve=Approvals("auto"),
                       date=variation.date if variation else None)
            finished = rt.agent.run(task.prompt, rt.system)
            rt.session.close()
        except Exception as e:  # noqa: BLE001 - the harness failed, not the model
            return EpisodeResult(task.id, "error", infra_error=f"{type(e).__name__}: {e}",
                                 duration_s=time.monotonic() - start)
        session_path = Path(rt.session.path)
        if keep_dir is not None:
            keep_dir.mkdir(parents=True, exist_ok=True)
            name = f"{_safe(task.id)}{'-' + label if label else ''}-{rt.session.id}.jsonl"
            session_path = Path(shutil.copy(session_path, keep_dir / name))
        res = EpisodeResult(task.id, finished.status, final_text=finished.final_text, session_path=str(session_path),
                            turns=finished.turns, prompt_tokens=finished.prompt_tokens,
                            completion_tokens=finished.completion_tokens, session=load(session_path))
        for rec in res.session.records:
            if rec["type"] == "tools" and rec.get("calls"):
                res.tool_calls += len(rec["calls"])
                res.turns_with_calls += 1
        if finished.status == "interrupted" or (finished.status == "error"
                                                and finished.error_kind not in POLICY_ERRORS):
            res.infra_error = finished.error or finished.status
        else:
            q = measure(task, baseline, finished.final_text, res.session) if baseline else None
            t0 = time.monotonic()
            res.passed, res.verify_output = ws.verify(finished.final_text)
            res.verify_s = time.monotonic() - t0
            if q is not None:
                res.extra.update(quality=q, verify_passed=res.passed)
                if q["test_edits"]:
                    res.passed = False
                    res.extra["fail_reason"] = f"edited tests or verifier files: {', '.join(q['test_edits'])}"
                elif not res.passed:
                    res.extra["fail_reason"] = "the verifier failed"
        res.duration_s = time.monotonic() - start
        return res
    except Exception:  # noqa: BLE001 - one broken episode must not take a whole run down
        return EpisodeResult(task.id, "error", infra_error=traceback.format_exc(limit=3),
                             duration_s=time.monotonic() - start)
    finally:
        if ws is not None:
            ws.cleanup()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:60]
