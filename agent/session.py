"""Sessions as trajectories: plain JSONL under `.composer/sessions/`, appended after every step.

Records (one JSON object per line, `type` first):

  session    id, created, cwd, base_url, model, spec_hash, tools (the specs sent), context_window
  message    segment, index, message                   every message appended to the conversation
  request    turn, segment, messages (how many of the segment's messages were sent), extra (messages
             sent after those, e.g. the summary prompt), purpose (turn | summary), spec_hash, usage,
             timings, finish_reason, reasoning; with record_tokens also prompt_token_ids,
             completion_token_ids, completion_logprobs (one per id) and policy_version (or null): exactly
             what the server tokenised and sampled (an interrupted turn: as far as it came); and where
             the server says so (composer-serve), serve_dtype and batch_invariant: how it computed them
  tools      turn, calls: [{id, name, ok, duration_s}]
  segment    segment, summary, tokens_before           the context was summarised; a new segment starts
  resumed    at
  mode       mode, at                                  the mode changed (code | ask | plan); a resumed
                                                       session starts in the last one recorded
  finished   status, turns, duration_s, prompt_tokens, completion_tokens, error

Messages are stored once, so the file grows linearly; `requests()` rebuilds exactly the message list
each request sent (what RL trains on). Lines are flushed and fsynced as they are written, so a killed
run loses at most the step in flight.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.protocol import Message

SESSIONS_DIR = "sessions"


class SessionNotFound(LookupError):
    pass


@dataclass
class SessionData:
    meta: dict[str, Any]
    segments: list[list[Message]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def mode(self) -> str | None:
        """The mode the session was last in; None when it never left code (no record)."""
        modes = [r["mode"] for r in self.records if r.get("type") == "mode"]
        return modes[-1] if modes else None

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> SessionData:
        """A session from its records, as written: meta from the `session` record, messages by segment."""
        data = cls(meta={}, records=records)
        for rec in records:
            if rec["type"] == "session":
                data.meta = rec
            elif rec["type"] in ("message", "segment"):
                while len(data.segments) <= rec["segment"]:
                    data.segments.append([])
                if rec["type"] == "message":
                    data.segments[rec["segment"]].append(rec["message"])
        return data

    @property
    def messages(self) -> list[Message]:
        """The current (last) segment's messages: what a resumed run continues from."""
        return self.segments[-1] if self.segments else []

    def requests(self) -> Iterator[tuple[dict[str, Any], list[Message]]]:
        """(request record, the exact messages it sent), in order."""
        segments: dict[int, list[Message]] = {}
        for rec in self.records:
            if rec["type"] == "message":
                segments.setdefault(rec["segment"], []).append(rec["message"])
            elif rec["type"] == "request":
                sent = segments.get(rec["segment"], [])[: rec["messages"]] + rec.get("extra", [])
                yield rec, json.loads(json.dumps(sent))


class Session:
    def __init__(self, path: Path, session_id: str):
        self.path = path
        self.id = session_id
        self.segment = 0
        self.counts: dict[int, int] = {}
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the session

    @classmethod
    def create(cls, sessions_dir: Path, **meta: Any) -> Session:
        sessions_dir.mkdir(parents=True, exist_ok=True)
        sid = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
        s = cls(sessions_dir / f"{sid}.jsonl", sid)
        s.write({"type": "session", "version": 1, "id": sid, "created": time.time(), **meta})
        return s

    @classmethod
    def resume(cls, sessions_dir: Path, which: str) -> tuple[Session, SessionData]:
        path = find_session(sessions_dir, which)
        data = load(path)
        s = cls(path, data.meta["id"])
        s.segment = len(data.segments) - 1 if data.segments else 0
        s.counts = {i: len(seg) for i, seg in enumerate(data.segments)}
        s.write({"type": "resumed", "at": time.time()})
        return s, data

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def add_message(self, message: Message) -> None:
        index = self.counts.get(self.segment, 0)
        self.counts[self.segment] = index + 1
        self.write({"type": "message", "segment": self.segment, "index": index, "message": message})

    def new_segment(self, summary: str, tokens_before: int) -> None:
        self.segment += 1
        self.write({"type": "segment", "segment": self.segment, "summary": summary, "tokens_before": tokens_before})

    def sent_count(self) -> int:
        return self.counts.get(self.segment, 0)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def find_session(sessions_dir: Path, which: str) -> Path:
    if which == "last":
        files = sorted(sessions_dir.glob("*.jsonl"), key=lambda p: p.stat().st_mtime) if sessions_dir.is_dir() else []
        if not files:
            raise SessionNotFound(f"no sessions to resume in {sessions_dir}")
        return files[-1]
    path = sessions_dir / f"{which.removesuffix('.jsonl')}.jsonl"
    if not path.is_file():
        matches = sorted(sessions_dir.glob(f"*{which}*.jsonl")) if sessions_dir.is_dir() else []
        if len(matches) == 1:
            return matches[0]
        raise SessionNotFound(f"no session {which!r} in {sessions_dir}")
    return path


def load(path: Path) -> SessionData:
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line torn by a kill: everything before it is intact
    return SessionData.from_records(records)
