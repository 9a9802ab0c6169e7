"""Training samples from recorded trajectories, token-exact: built from the ids the server sampled.

A trajectory is the session JSONL the agent writes with `--record-tokens`: every `request` record
carries `prompt_token_ids`, `completion_token_ids`, `completion_logprobs` and `policy_version`.
Nothing is re-tokenised. Requests are chained while rendering is append-only: request k+1 joins the
sample of request k when its prompt starts with request k's prompt + completion; the tokens between
(tool results, the next user message, the template's separators) are context (mask 0) and the
completion is trained on (mask 1). When the prefix does not hold (a summary request, the compacted
context after it, a template that rewrote history, a completion cut by max_tokens) a new segment
starts; every segment of an episode gets the episode's reward.

Routed experts (routing replay): where a request record carries `routed_experts` (composer-serve's,
serve/routed_experts.py), the sample keeps, per token, the experts each MoE layer used when the server
read it, and the trainer routes those tokens the same way; tokens without (another server, a request
cut short) are routed by the trainer itself (-1).

Refused with a clear TrajectoryError: requests recorded without token ids, a tool spec hash other than
the one the model is trained for, and prompts that the model's own chat format does not reproduce
(another chat template or tokenizer) when `chat` is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.session import SessionData
from serve import routed_experts

TOKEN_FIELDS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs")


class TrajectoryError(ValueError):
    """A trajectory that cannot be trained on as it is (the message says why and what to do)."""


@dataclass
class Sample:
    """One segment of an episode: a token sequence with the sampled tokens marked."""

    episode: str
    segment: int
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 where the server sampled the token
    sampler_logprobs: list[float] = field(default_factory=list)  # the server's, 0.0 where mask is 0
    versions: list[int] = field(default_factory=list)  # policy version of each request in the segment
    requests: int = 0
    routes: np.ndarray | None = None  # [len(token_ids), M, K] int16: the server's experts per token, -1: none

    def extend(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.token_ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.sampler_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def add_routes(self, start: int, routes_TMK: np.ndarray) -> None:
        """The server's experts of tokens start .. start+T-1 (those past the sample's end are dropped)."""
        n = len(self.token_ids)
        if self.routes is None:
            self.routes = np.full((n, *routes_TMK.shape[1:]), -1, dtype=np.int16)
        elif self.routes.shape[1:] != routes_TMK.shape[1:]:
            raise TrajectoryError(f"routed experts of shape {list(routes_TMK.shape[1:])} after "
                                  f"{list(self.routes.shape[1:])} in one episode")
        if len(self.routes) < n:
            grow = np.full((n - len(self.routes), *self.routes.shape[1:]), -1, dtype=np.int16)
            self.routes = np.concatenate([self.routes, grow])
        end = min(n, start + len(routes_TMK))
        if end > start:
            self.routes[start:end] = routes_TMK[: end - start]

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else 0

    @property
    def sampled_tokens(self) -> int:
        return sum(self.mask)


def token_requests(data: SessionData) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(request record, messages sent) of every request, checking each carries token ids."""
    out = []
    for rec, sent in data.requests():
        missing = [k for k in TOKEN_FIELDS if rec.get(k) is None]
        if missing:
            raise TrajectoryError(
                f"session {data.meta.get('id')}: request of turn {rec.get('turn')} has no {', '.join(missing)}; "
                "record trajectories with `composer-agent --record-tokens` against a server that returns token ids")
        if len(rec["completion_logprobs"]) != len(rec["completion_token_ids"]):
            raise TrajectoryError(f"session {data.meta.get('id')}: turn {rec.get('turn')} has "
                                  f"{len(rec['completion_token_ids'])} completion ids but "
                                  f"{len(rec['completion_logprobs'])} logprobs")
        out.append((rec, sent))
    return out


def check_spec_hash(data: SessionData, expected: str | None) -> None:
    got = data.meta.get("spec_hash")
    if expected is not None and got != expected:
        raise TrajectoryError(
            f"session {data.meta.get('id')} was recorded with tool spec hash {got}, but this run trains for "
            f"{expected}: the tools (names, parameters or descriptions) changed since; record it again")


def check_rendering(data: SessionData, chat, requests=None) -> None:
    """Every recorded prompt must be what the model's chat format renders for the messages sent."""
    tools = data.meta.get("tools") or None
    for rec, sent in requests if requests is not None else token_requests(data):
        want = chat.render_ids(sent, tools if rec.get("purpose", "turn") == "turn" else None)
        got = rec["prompt_token_ids"]
        if want != got:
            at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
            raise TrajectoryError(
                f"session {data.meta.get('id')}, turn {rec.get('turn')}: the recorded prompt ({len(got)} tokens) "
                f"differs from {chat.dir}'s chat template + tokenizer ({len(want)} tokens) from token {at} on: "
                "the trajectory was rendered by another chat template or tokenizer")


def failed_turns(data: SessionData) -> set[int]:
    """Indices (among the session's requests) of the turns with a tool call that failed: a tool result
    starting "Error:" right after the assistant message the request produced."""
    out, index = set(), 0
    for rec in data.records:
        if rec["type"] != "request":
            continue
        msgs = data.segments[rec["segment"]] if rec["segment"] < len(data.segments) else []
        at = rec["messages"]
        if at < len(msgs) and msgs[at].get("role") == "assistant" and msgs[at].get("tool_calls"):
            for m in msgs[at + 1:]:
                if m.get("role") != "tool":
                    break
                if str(m.get("content") or "").startswith("Error:"):
                    out.add(index)
                    break
        index += 1
    return out


def served_numerics(data: SessionData) -> tuple[str | None, bool]:
    """(serve_dtype, batch_invariant) the session's token requests were computed with (composer-serve says
    so in every response; None, False where a server did not). Mixed within one session: TrajectoryError."""
    seen = {(r.get("serve_dtype"), bool(r.get("batch_invariant"))) for r, _ in token_requests(data)}
    if len(seen) > 1:
        raise TrajectoryError(f"session {data.meta.get('id')}: requests served in different numerics {sorted(seen, key=str)}")
    return seen.pop() if seen else (None, False)


def build_samples(data: SessionData, *, chat=None, spec_hash: str | None = None,
                  train_failed: bool = True) -> list[Sample]:
    """The episode's segments as samples (see the module docstring). `train_failed=False` (imitation
    learning): a turn with a failed tool call is context, not a target (the expert's deliberate
    mistakes, whose recovery is what is taught)."""
    check_spec_hash(data, spec_hash)
    requests = token_requests(data)
    if chat is not None:
        check_rendering(data, chat, requests)
    skip = set() if train_failed else failed_turns(data)
    return chain(str(data.meta.get("id", "")), [rec for rec, _ in requests], skip)


def chain(episode: str, requests: list[dict[str, Any]], skip: set[int] = frozenset()) -> list[Sample]:
    """Requests (prompt_token_ids, completion_token_ids, completion_logprobs, optional routed_experts and
    policy_version) chained into samples while each prompt extends the last; completions of the requests
    in `skip` are context. Shared by recorded ids (above) and teacher renderings (train/teacher.py)."""
    samples: list[Sample] = []
    cur: Sample | None = None
    for n, rec in enumerate(requests):
        prompt, completion = rec["prompt_token_ids"], rec["completion_token_ids"]
        logprobs = [float(x) if x is not None else 0.0 for x in rec["completion_logprobs"]]
        if cur is not None and len(prompt) >= len(cur.token_ids) and prompt[: len(cur.token_ids)] == cur.token_ids:
            cur.extend(prompt[len(cur.token_ids):], sampled=False)
        else:
            cur = Sample(episode, len(samples))
            samples.append(cur)
            cur.extend(list(prompt), sampled=False)
        cur.extend(list(completion), sampled=n not in skip, logprobs=None if n in skip else logprobs)
        if rec.get("routed_experts") is not None:
            try:
                cur.add_routes(*routed_experts.decode(rec["routed_experts"]))
            except ValueError as e:
                raise TrajectoryError(f"session {episode}, turn {rec.get('turn')}: {e}") from None
        cur.versions.append(int(rec.get("policy_version") or 0))
        cur.requests += 1
    return [s for s in samples if s.sampled_tokens]
