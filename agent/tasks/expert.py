"""The scripted expert: a program that answers like a model over loopback and solves the synthetic
families through the real harness, following each task's plan (agent.tasks.families.expert_plan).

It recognises the task by the conversation's first user message and the step by how many assistant
turns came before; tool results do not change the plan (it is a solution known in advance, which is
what makes its pass rate a check of the verifiers). Its trajectories are the SFT data for small models.

    python -m agent.tasks.expert SUITE [--port 8000]      # serve the expert for a suite
"""

from __future__ import annotations

import argparse
from typing import Any

from agent.scripted import DEFAULT_SUMMARY, ScriptedServer
from agent.tasks.spec import Task
from agent.tasks.workspace import _safe

UNKNOWN = {"content": "I don't know this task."}


def plans(tasks: list[Task], mistakes: float = 0.0) -> dict[str, list[tuple[str, list[dict[str, Any]]]]]:
    """Each prompt's (task id, plan) pairs: tasks of different seeds can share a prompt ("where is
    `clamp` defined?") while their repositories, and so their solutions, differ. `mistakes`: the share
    of one-edit plans with a failed edit and its recovery (families.expert_plan)."""
    from agent.tasks.families import expert_plan

    out: dict[str, list[tuple[str, list[dict[str, Any]]]]] = {}
    for t in tasks:
        if t.generator:
            out.setdefault(t.prompt, []).append((t.id, expert_plan(t, mistakes)))
    return out


def _pick(candidates: list[tuple[str, list[dict[str, Any]]]], messages: list[dict[str, Any]]):
    """The plan of the task whose workspace this is: isolated workspaces are named after the task id
    (agent.tasks.workspace), and the system prompt names the workspace root."""
    if len(candidates) == 1:
        return candidates[0][1]
    system = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "system")
    for task_id, plan in candidates:
        if f"composer-{_safe(task_id)}-" in system:
            return plan
    return candidates[0][1]


def expert_turn(plan_by_prompt: dict[str, list[tuple[str, list[dict[str, Any]]]]],
                messages: list[dict[str, Any]], tools: Any) -> dict[str, Any]:
    """The expert's next turn for a conversation (a summary when asked without tools)."""
    if not tools:
        return {"content": DEFAULT_SUMMARY}
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    found = next((plan_by_prompt[u] for u in users if u in plan_by_prompt), None)
    if found is None:
        return UNKNOWN
    plan = _pick(found, messages)
    step = sum(1 for m in messages if m.get("role") == "assistant")
    return plan[min(step, len(plan) - 1)] if step < len(plan) else {"content": plan[-1].get("content", "Done.")}


class ExpertServer(ScriptedServer):
    """An OpenAI-compatible loopback server that plays the expert for many tasks at once."""

    def __init__(self, tasks: list[Task], **kw: Any):
        super().__init__([], model=kw.pop("model", "expert"), **kw)
        self.plans = plans(tasks)

    def next_turn(self, body: dict[str, Any]) -> dict[str, Any]:
        return expert_turn(self.plans, body.get("messages") or [], body.get("tools"))


def main(argv: list[str] | None = None) -> int:
    import time

    from agent.tasks.suites import load_tasks

    p = argparse.ArgumentParser(prog="python -m agent.tasks.expert", description="Serve the scripted expert.")
    p.add_argument("suite", help="a built-in suite name or a tasks JSONL")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    with ExpertServer(load_tasks(args.suite), port=args.port) as srv:
        print(f"expert for {args.suite} at {srv.base_url} (model 'expert'); Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
