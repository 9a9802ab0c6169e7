"""Teacher data without token ids: conversations rendered through the model's own chat template.

A stronger model's sessions (our agent against any OpenAI-compatible server) and transcripts from
elsewhere (OpenAI-style message lists with tool calls) carry text, not our model's ids. Each assistant
message becomes one request: its prompt is `ChatFormat.render_ids(messages before it, tools)`, exactly
the ids composer-serve builds for that request, and its completion is the text the template renders for
the message itself (up to and including the end-of-turn token), tokenized: what our model would have had
to sample to say the same. The requests then chain into samples as recorded ones do (train/samples.py
`chain`): loss on the assistant's tokens, everything else context.

Refused with the reason (TeacherError), whole, since a half-rendered session teaches a truncated
conversation: tools other than the ones the model is trained for (the spec hash), a tool call naming
a tool not offered or with arguments its schema rejects (we would teach a call that cannot run), a
conversation the template rejects, or one with no assistant message. Limits: a session's summary
requests are not trained on (their text is not recorded as a message); a template that rewrites
history (drops old reasoning) starts a new sample at that point, as with recorded ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent.session import SessionData
from agent.tools import default_registry
from agent.tools.registry import spec_hash as hash_specs
from serve.chat_format import ChatFormat, ChatFormatError
from train.rewards import _malformed
from train.samples import Sample, chain, failed_turns


class TeacherError(ValueError):
    """A conversation that cannot be taught as it is; the message says why."""


def conversation_requests(data: SessionData) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """(messages sent, the assistant message it produced) of every model turn of a recorded session."""
    out = []
    pending: list[dict[str, Any]] | None = None
    for rec, sent in data.requests():
        pending = sent if rec.get("purpose", "turn") == "turn" else None
        reply = _reply_after(data, rec)
        if pending is not None and reply is not None:
            out.append((pending, reply))
    return out


def _reply_after(data: SessionData, req: dict[str, Any]) -> dict[str, Any] | None:
    """The assistant message written right after `req` (the loop writes the request, then its reply)."""
    seen = False
    for rec in data.records:
        if rec is req:
            seen = True
        elif seen and rec["type"] == "message":
            return rec["message"] if rec["message"].get("role") == "assistant" else None
        elif seen and rec["type"] == "request":
            return None
    return None


def transcript_requests(messages: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """(messages before it, the assistant message) for each assistant message of a plain transcript."""
    return [(messages[:i], m) for i, m in enumerate(messages) if m.get("role") == "assistant"]


def render_samples(episode: str, turns: list[tuple[list[dict[str, Any]], dict[str, Any]]],
                   tools: list[dict[str, Any]] | None, chat: ChatFormat, *, expected_hash: str | None = None,
                   skip: set[int] = frozenset()) -> list[Sample]:
    """Samples for a conversation's assistant turns, rendered by `chat` (see the module docstring)."""
    if not turns:
        raise TeacherError(f"{episode}: no assistant message to learn from")
    if expected_hash is not None:
        got = hash_specs(tools or [])
        if got != expected_hash:
            raise TeacherError(f"{episode}: its tools hash to {got}, the model is trained for {expected_hash}: "
                               "other tools (names, parameters or descriptions); record it with this version's tools")
    schemas = {(s.get("function", s)).get("name", ""): (s.get("function", s)).get("parameters") or {}
               for s in tools or []}
    validators: dict[str, Any] = {}
    end = chat.special_tokens.get("eos_token") or "<|im_end|>"
    requests = []
    for n, (before, reply) in enumerate(turns):
        for call in reply.get("tool_calls") or []:
            if _malformed(call, schemas, validators):
                fn = call.get("function") or {}
                raise TeacherError(f"{episode}, assistant turn {n + 1}: the call {fn.get('name')!r} with arguments "
                                   f"{str(fn.get('arguments'))[:120]} does not fit the tools' schemas")
        message = {k: v for k, v in reply.items() if k in ("role", "content", "tool_calls", "reasoning_content",
                                                            "reasoning", "thinking")}
        try:
            prompt = chat.render(before, tools, True)
            full = chat.render([*before, message], tools, False)
        except ChatFormatError as e:
            raise TeacherError(f"{episode}, assistant turn {n + 1}: {e}") from None
        if not full.startswith(prompt):
            raise TeacherError(f"{episode}, assistant turn {n + 1}: the chat template does not render the reply "
                               "after its prompt (it rewrites the conversation), so no completion can be cut out")
        text = full[len(prompt):]
        text = text[: text.index(end) + len(end)] if end in text else text
        ids = chat.encode(text)
        requests.append({"prompt_token_ids": chat.encode(prompt), "completion_token_ids": ids,
                         "completion_logprobs": [0.0] * len(ids), "turn": n + 1})
    return chain(episode, requests, set(skip))


def session_samples(data: SessionData, chat: ChatFormat, *, expected_hash: str | None = None,
                    train_failed: bool = True) -> list[Sample]:
    """A recorded session (ids or none) rendered as teacher data."""
    turns = conversation_requests(data)
    episode = str(data.meta.get("id", ""))
    if expected_hash is not None and data.meta.get("spec_hash") not in (None, expected_hash):
        raise TeacherError(f"session {episode} was recorded with tool spec hash {data.meta.get('spec_hash')}, "
                           f"the model is trained for {expected_hash}")
    skip: set[int] = set()
    if not train_failed:  # failed_turns counts every request; keep the model turns' positions
        kinds = [r.get("purpose", "turn") for r in data.records if r["type"] == "request"]
        turn_index = {i: sum(k == "turn" for k in kinds[:i]) for i, k in enumerate(kinds) if k == "turn"}
        skip = {turn_index[i] for i in failed_turns(data) if i in turn_index}
    return render_samples(episode, turns, data.meta.get("tools"), chat, expected_hash=expected_hash, skip=skip)


def load_transcripts(path: Path) -> list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """(name, messages, tools) of each conversation in a transcript file: JSON (one {"messages", "tools"}
    object, or a bare message list) or JSONL (one such object a line)."""
    text = path.read_text()
    try:
        items = [json.loads(text)]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise TeacherError(f"{path}: neither JSON nor JSONL ({e})") from None
    out = []
    for i, item in enumerate(items):
        if isinstance(item, list):
            item = {"messages": item}
        if not isinstance(item, dict) or not isinstance(item.get("messages"), list):
            raise TeacherError(f"{path}: conversation {i + 1} is not a message list or a {{\"messages\": [...]}} object")
        out.append((f"{path.name}#{i + 1}", item["messages"], item.get("tools")))
    return out


def teacher_samples(path: Path, chat: ChatFormat, *, train_failed: bool = True) -> list[Sample]:
    """Samples from one file: a session JSONL (first record {"type": "session"}) or a transcript file.
    Transcripts without a "tools" list are taken to use this version's tools."""
    from agent.session import load

    expected = default_registry().spec_hash()
    first = path.read_text().split("\n", 1)[0]
    try:
        head = json.loads(first) if first.strip() else None
    except json.JSONDecodeError:
        head = None
    if isinstance(head, dict) and head.get("type") == "session":
        return session_samples(load(path), chat, expected_hash=expected, train_failed=train_failed)
    samples = []
    for name, messages, tools in load_transcripts(path):
        samples += render_samples(name, transcript_requests(messages),
                                  tools if tools is not None else default_registry().specs(), chat,
                                  expected_hash=expected)
    return samples
