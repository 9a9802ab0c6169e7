"""The context: the system prompt (with AGENTS.md), the token budget, and compaction by summary.

Past `summarize_at` of the window the loop asks the model for a structured summary (prompts/
summarize.md) and continues from: the system prompt, every message the user wrote (instructions are
what agents most often forget after compaction, so they are kept verbatim), the summary, and the
most recent turns that fit in a quarter of the window (never splitting a tool call from its result).
Token counts come from the server's usage where there is one, else from a 4-chars-per-token estimate.
"""

from __future__ import annotations

import json
import platform
import time
from importlib import resources
from pathlib import Path

from agent.client import estimate_tokens
from agent.config import user_config_dir
from agent.protocol import Message

TAIL_FRACTION = 0.25
SUMMARY_HEADER = "Summary of the work so far (earlier messages were compacted):\n\n"
MAX_TOOL_CHARS_IN_SUMMARY_REQUEST = 4000


def prompt_text(name: str) -> str:
    return resources.files("agent").joinpath("prompts", name).read_text(encoding="utf-8")


def system_prompt(root: Path, extra_roots: tuple[Path, ...] = (), date: str | None = None) -> str:
    """`date` (YYYY-MM-DD) stands in for today's: training episodes name varied ones (agent/tasks/variation.py)."""
    text = prompt_text("system.md").format(
        cwd=root, platform=f"{platform.system()} {platform.machine()}", date=date or time.strftime("%Y-%m-%d"),
        git=_git_line(root))
    if extra_roots:
        text += "\n\nThe user also gave you these folders (use absolute paths for them):\n" + "\n".join(
            f"- {r}" for r in extra_roots)
    for label, path in (("Project instructions (AGENTS.md)", root / "AGENTS.md"),
                        ("User instructions", user_config_dir() / "AGENTS.md")):
        try:
            extra = path.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            continue
        if extra:
            text += f"\n\n# {label}\n{extra}"
    return text.rstrip() + "\n"


def _git_line(root: Path) -> str:
    head = root / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
    except OSError:
        return "- Not a git repository."
    branch = ref.removeprefix("ref: refs/heads/") if ref.startswith("ref:") else f"detached at {ref[:12]}"
    return f"- Git repository, branch {branch}."


def estimate_messages(messages: list[Message]) -> int:
    return sum(estimate_tokens(m) for m in messages)


def summary_request(messages: list[Message], window: int) -> list[Message]:
    """The messages to send when asking for a summary: long tool outputs cut so the request fits."""
    out = [dict(m) for m in messages]
    if estimate_messages(out) > 0.85 * window:
        for m in out:
            content = m.get("content")
            if m.get("role") == "tool" and isinstance(content, str) and len(content) > MAX_TOOL_CHARS_IN_SUMMARY_REQUEST:
                half = MAX_TOOL_CHARS_IN_SUMMARY_REQUEST // 2
                m["content"] = content[:half] + "\n… [cut for the summary request] …\n" + content[-half:]
    # Oldest non-system turns go first if it still does not fit.
    while estimate_messages(out) > 0.85 * window and len(out) > 3:
        del out[1]
    return out + [{"role": "user", "content": prompt_text("summarize.md")}]


def compact(messages: list[Message], summary: str, window: int) -> list[Message]:
    """The new segment's opening messages after a summary: system, the user's own messages (kept
    verbatim, including those carried over from earlier compactions), the summary, the latest turns."""
    system = messages[0]
    users = [dict(m) for m in messages[1:] if m.get("role") == "user"
             and not str(m.get("content", "")).startswith(SUMMARY_HEADER)]
    head = users + [{"role": "user", "content": SUMMARY_HEADER + summary.strip()}]
    return [system] + head + _tail(messages, int(window * TAIL_FRACTION))


def _tail(messages: list[Message], budget: int) -> list[Message]:
    """The latest whole turns (an assistant message with all its tool results) within `budget` tokens."""
    turns: list[list[Message]] = []
    current: list[Message] = []
    for m in messages[1:]:
        if m.get("role") == "assistant":
            if current:
                turns.append(current)
            current = [m]
        elif m.get("role") == "tool" and current:
            current.append(m)
        else:
            if current:
                turns.append(current)
            current = []
    if current:
        turns.append(current)
    kept: list[list[Message]] = []
    used = 0
    for turn in reversed(turns):
        cost = estimate_tokens(json.dumps(turn))
        if used + cost > budget:
            break
        kept.insert(0, turn)
        used += cost
    return [m for turn in kept for m in turn]
