"""Tasks: one format for RL training and evaluation (workspace source, prompt, hidden verify command,
limits), isolated workspaces, the suites that ship, the scripted expert and the eval runner."""

from agent.tasks.spec import Task, TaskError, write_tasks
from agent.tasks.suites import load_tasks
from agent.tasks.workspace import Workspace

__all__ = ["Task", "TaskError", "Workspace", "load_tasks", "write_tasks"]
