"""Scripted experts that find a definition by looking, not from a plan (issue 55: what semantic search
adds to the agent).

    expert-grep    grep for `def NAME(` and answer with the file and line the grep printed
    expert-search  semantic_search for NAME first (the workspace's embedding index, built on first use
                   with the configured embedder: code-minilm by default, $COMPOSER_EMBED_MODEL=minilm
                   for MiniLM) and answer from a hit whose snippet shows `def NAME(`; grep when none does

Only "where is X defined?" questions (recognised by the prompt's words) are played this way; every
other task follows its plan as the plain `expert` does (agent/tasks/expert.py). Neither variant knows
the answer: the name comes from the prompt, the file and line from what the tools printed, so a wrong
or empty tool result gives a wrong or "not found" answer. Selected with `composer-agent eval SUITE
--expert --model expert-search` (or expert-grep).
"""

from __future__ import annotations

import re
from typing import Any

from agent.tasks.expert import ExpertServer
from agent.tasks.spec import Task

GREP, SEARCH = "expert-grep", "expert-search"
VARIANTS = (GREP, SEARCH)
SEARCH_K = 3  # hits asked for: an exact name usually ranks first; three keep the answer short
MAX_LOOKS = 3  # tool turns before giving up
# The question forms of the find-def family (agent/tasks/families) and close paraphrases.
_ASKED = [re.compile(p, re.I) for p in (
    r"where is `?([A-Za-z_]\w*)`?(?:\(\))? defined",
    r"definition of `?([A-Za-z_]\w*)`?",
    r"find where `?([A-Za-z_]\w*)`?(?:\(\))? is (?:implemented|defined)",
)]
_HIT = re.compile(r"^\d+\. (\S+):(\d+)-(\d+)\s")  # semantic_search's hit header: "1. pkg/a.py:3-9  name  (score ..)"
_NUMBERED = re.compile(r"^\s*(\d+)\t(.*)$")  # its snippet lines: "     7\tdef name(...):"
_GREP_HIT = re.compile(r"^(\S+?):(\d+):(.*)$")  # grep's content lines: "pkg/a.py:7:def name(...):"


def asked_name(prompt: str) -> str | None:
    """The name a "where is X defined?" question asks about (None: not such a question)."""
    for pat in _ASKED:
        m = pat.search(prompt or "")
        if m:
            return m.group(1)
    return None


def _is_definition(text: str, name: str) -> bool:
    return re.match(rf"\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\s*[(:]", text) is not None


def found_in_search(output: str, name: str) -> tuple[str, int] | None:
    """(path, line) of the first semantic_search hit whose snippet shows the definition of `name`."""
    path = None
    for line in output.splitlines():
        head = _HIT.match(line)
        if head:
            path = head.group(1)
            continue
        m = _NUMBERED.match(line)
        if path and m and _is_definition(m.group(2), name):
            return path, int(m.group(1))
    return None


def found_in_grep(output: str, name: str) -> tuple[str, int] | None:
    """(path, line) of the first grep content line that defines `name`."""
    for line in output.splitlines():
        m = _GREP_HIT.match(line)
        if m and _is_definition(m.group(3), name):
            return m.group(1), int(m.group(2))
    return None


def _grep_call(name: str) -> dict[str, Any]:
    return {"name": "grep", "arguments": {"pattern": f"def {name}\\(", "output_mode": "content"}}


def _last_look(messages: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(tool name, its output) of the last tool call, from the conversation (None before any)."""
    calls = {}
    for m in messages:
        for c in m.get("tool_calls") or []:
            calls[c.get("id")] = (c.get("function") or {}).get("name", "")
    for m in reversed(messages):
        if m.get("role") == "tool":
            return calls.get(m.get("tool_call_id"), ""), str(m.get("content") or "")
        if m.get("role") == "assistant":
            return None
    return None


def find_turn(name: str, search: bool, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The next turn of a find-def conversation: look (search or grep), read what came back, answer."""
    looks = sum(1 for m in messages if m.get("role") == "assistant")
    last = _last_look(messages)
    if last is None:
        if looks:
            return {"content": f"I could not find where `{name}` is defined."}
        if search:
            return {"tool_calls": [{"name": "semantic_search", "arguments": {"query": name, "k": SEARCH_K}}]}
        return {"tool_calls": [_grep_call(name)]}
    tool, output = last
    hit = found_in_search(output, name) if tool == "semantic_search" else found_in_grep(output, name)
    if hit is not None:
        return {"content": f"`{name}` is defined in {hit[0]}, line {hit[1]}."}
    if tool == "semantic_search" and looks < MAX_LOOKS:
        return {"reasoning": f"The search did not show the definition of {name}; grep for it.",
                "tool_calls": [_grep_call(name)]}
    return {"content": f"I could not find where `{name}` is defined."}


EXPERTS = ("expert", GREP, SEARCH)


def expert_server(tasks: list[Task], model: str | None = None, **kw: Any) -> ExpertServer:
    """The scripted expert named `model`: "expert" (or None), the plan-following one; "expert-grep" and
    "expert-search", the ones here."""
    if model in (None, "expert"):
        return ExpertServer(tasks, **kw)
    if model in VARIANTS:
        return FindExpertServer(tasks, model=model, **kw)
    raise ValueError(f"unknown scripted expert {model!r} (known: {', '.join(EXPERTS)})")


class FindExpertServer(ExpertServer):
    """The expert with find-def questions answered by looking (`expert-grep` or `expert-search`)."""

    def __init__(self, tasks: list[Task], model: str = SEARCH, **kw: Any):
        if model not in VARIANTS:
            raise ValueError(f"unknown expert variant {model!r} (known: {', '.join(VARIANTS)})")
        super().__init__(tasks, model=model, **kw)
        self.search = model == SEARCH

    def next_turn(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages") or []
        if body.get("tools"):
            name = next((n for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)
                         for n in [asked_name(m["content"])] if n), None)
            if name:
                return find_turn(name, self.search, messages)
        return super().next_turn(body)
