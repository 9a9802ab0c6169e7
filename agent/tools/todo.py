"""todo_write: the agent's visible task list, replaced whole on each call."""

from __future__ import annotations

from typing import Literal, TypedDict

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext

MARKS = {"completed": "[x]", "in_progress": "[~]", "pending": "[ ]"}


class TodoItem(TypedDict):
    content: str
    status: Literal["pending", "in_progress", "completed"]


@tool(parallel_safe=False, mutates=False)
def todo_write(ctx: ToolContext, todos: list[TodoItem]) -> ToolResult:
    """Replace the task list with `todos` and show it. Use it for work of three or more steps: write the
    plan, keep exactly one item in_progress while working on it, mark items completed as soon as they are
    done. The list is shown to the user.

    Args:
        todos: The whole list, in order; each item has `content` (what to do) and `status`
            ("pending", "in_progress" or "completed").
    """
    cleaned = []
    for i, item in enumerate(todos):
        content = item["content"].strip()
        if not content:
            raise ToolError(f"todo {i + 1} has empty content")
        cleaned.append({"content": content, "status": item["status"]})
    ctx.todos[:] = cleaned
    if not cleaned:
        return ToolResult("Todo list cleared.", data={"todos": []})
    done = sum(t["status"] == "completed" for t in cleaned)
    lines = [f"{MARKS[t['status']]} {t['content']}" for t in cleaned]
    note = ""
    active = sum(t["status"] == "in_progress" for t in cleaned)
    if active > 1:
        note = f"\nNote: {active} items are in_progress; keep one at a time."
    return ToolResult(f"Todos ({done}/{len(cleaned)} done):\n" + "\n".join(lines) + note,
                      data={"todos": cleaned})
