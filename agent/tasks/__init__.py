"""Tasks: one format for RL training and evaluation (workspace, prompt, hidden verify command, limits)."""

from agent.tasks.spec import Task, TaskError, load_tasks
from agent.tasks.workspace import Workspace, verify

__all__ = ["Task", "TaskError", "Workspace", "load_tasks", "verify"]
