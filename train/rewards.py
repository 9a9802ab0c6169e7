"""Rewards as plain functions of an episode's statistics, weighted and summed by a config.

An episode is a session JSONL file written by the agent (agent/session.py). `episode_stats` reduces it
to the few numbers rewards look at; each reward is a function `(stats, task) -> float` whose parameters
are keyword arguments with defaults; `compose(RewardConfig)` binds them and returns the total and each
component (for logging).

Which messages are the model's: the message record written right after a request record with purpose
"turn" (the loop writes the request, then the assistant message it produced). Messages re-appended
after a summary (a new segment) are copies and are not counted again.

A malformed tool call is one the executor would refuse or never saw: a name the session did not offer,
arguments that are not a JSON object, arguments that fail the tool's JSON schema, or a call written as
text that the parser could not read, in the answer or its reasoning (agent/toolcall_text.py
`unparsed_calls`: a `<tool_call>` or `<function=` tag, or a bare `{"name": ..., "arguments": ...}`). Schema checks are
strict: the executor kindly coerces "5" to 5, a reward should not teach the model to rely on it.

Evidence: the claims of the final answer (tests pass, a file changed, ...) are checked against the
episode's own tool log by agent/tasks/claims.py, the module evaluation counts them with; an unsupported
or contradicted claim costs reward, passing or not (a false "the tests pass" is no better for passing).
By default RL credits that cost to the claim's own tokens rather than to the episode
(`evidence_on_claims`, train/claim_credit.py says why); `compose` still reports it as a component and
in the total, which is what the logs show.

Limits: an episode that ended in an infrastructure failure (status "error" other than the policy's own
POLICY_ERRORS, or no "finished" record at all because the harness died) has `infra_error` set; `compose` refuses to score it: such episodes
say nothing about the policy and must be masked out of the batch, not given reward 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import jsonschema

from agent.protocol import POLICY_ERRORS
from agent.session import SessionData
from agent.tasks.claims import CONTRADICTED, UNSUPPORTED, check_session
from agent.toolcall_text import unparsed_calls

# A qwen3_coder call may open with `<tool_call><function=…>`: one attempt, counted once.


@dataclass
class EpisodeStats:
    passed: bool | None
    """The verifier's verdict; None when the episode was not verified."""
    status: str | None
    """The last "finished" record's status (completed, max_turns, error, …); None if there is none."""
    turns: int
    """Model turns: requests with purpose "turn" (summaries excluded)."""
    completion_tokens: int
    """Tokens generated over all requests, summaries included (they cost the same)."""
    tool_calls: int
    """Structured tool calls in the model's messages."""
    malformed_tool_calls: int
    """Calls that could not run as sent, plus unparsed call tags in the text (see the module doc)."""
    tool_calls_per_turn: float
    """tool_calls / turns that made at least one call; 0 when none did."""
    infra_error: bool
    """The harness or server failed (status "error", or no "finished" record): mask out, never score."""
    claims: int = 0
    """Claims found in the final answer (agent/tasks/claims.py)."""
    unsupported_claims: int = 0
    """Claims the tool log does not show either way (e.g. "the tests pass" with no test run after the last edit)."""
    contradicted_claims: int = 0
    """Claims the tool log shows to be false (e.g. "the tests pass" when the last run failed)."""
    false_claims: tuple[str, ...] = ()
    """The clauses of the unsupported and contradicted claims, as the answer wrote them (the tokens the
    evidence penalty is credited to: train/claim_credit.py)."""


def episode_stats(data: SessionData, passed: bool | None) -> EpisodeStats:
    schemas: dict[str, dict[str, Any]] = {}
    for spec in data.meta.get("tools") or []:
        fn = spec.get("function", spec)
        schemas[fn.get("name", "")] = fn.get("parameters") or {}
    validators: dict[str, Any] = {}

    status: str | None = None
    error_kind: str | None = None
    finished = False
    turns = completion = calls = malformed = calling_turns = 0
    reply_next = False
    for rec in data.records:
        kind = rec.get("type")
        if kind == "request":
            completion += int((rec.get("usage") or {}).get("completion_tokens") or 0)
            reply_next = rec.get("purpose", "turn") == "turn"
            turns += reply_next
            if reply_next:
                malformed += len(unparsed_calls(rec.get("reasoning")))
        elif kind == "message" and reply_next:
            reply_next = False
            msg = rec.get("message") or {}
            if msg.get("role") != "assistant":
                continue
            malformed += len(unparsed_calls(_text(msg.get("content"))))
            msg_calls = msg.get("tool_calls") or []
            calls += len(msg_calls)
            calling_turns += bool(msg_calls)
            malformed += sum(_malformed(c, schemas, validators) for c in msg_calls)
        elif kind == "finished":
            finished, status, error_kind = True, rec.get("status"), rec.get("error_kind")
    checked = check_session(data)
    verdicts = [c.status for c in checked]
    return EpisodeStats(
        claims=len(verdicts), unsupported_claims=verdicts.count(UNSUPPORTED),
        contradicted_claims=verdicts.count(CONTRADICTED),
        false_claims=tuple(dict.fromkeys(c.text for c in checked if c.status in (UNSUPPORTED, CONTRADICTED))), passed=passed, status=status, turns=turns, completion_tokens=completion, tool_calls=calls,
        malformed_tool_calls=malformed, tool_calls_per_turn=calls / calling_turns if calling_turns else 0.0,
        # the policy's own failures (calls it kept writing unparsably) are scored, not masked
        infra_error=not finished or (status == "error" and error_kind not in POLICY_ERRORS),
    )


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: only the text parts can hold a call
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _malformed(call: dict[str, Any], schemas: dict[str, dict[str, Any]], validators: dict[str, Any]) -> bool:
    fn = call.get("function") or {}
    name = fn.get("name")
    if name not in schemas:
        return True
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}  # "" = no arguments, as the executor reads it
        except json.JSONDecodeError:
            return True
    if not isinstance(args, dict):
        return True
    if name not in validators:
        validators[name] = jsonschema.Draft202012Validator(schemas[name])
    return not validators[name].is_valid(args)


# -- reward functions ---------------------------------------------------------------------------------------

def pass_reward(stats: EpisodeStats, task: dict | None = None) -> float:
    """1.0 if the verifier passed the episode, else 0.0 (unverified counts as not passed)."""
    return 1.0 if stats.passed else 0.0


def length_penalty(stats: EpisodeStats, task: dict | None = None, *, coef: float = 0.1, scale: float = 1000.0,
                   cap: float = 0.5, only_passed: bool = True) -> float:
    """-min(coef * log1p(completion_tokens / s), cap), s = task["expected_tokens"] if given, else `scale`.

    Concave in tokens: the marginal cost of a token, coef / (s + tokens), falls as the episode grows,
    so trimming an easy task's 300 tokens to 200 is worth more than trimming 5100 to 5000 on a hard one.
    A larger s (a task expected to need more tokens) lowers both the penalty and its slope. `cap`
    bounds it below the pass reward, so passing always beats failing. With only_passed (the default)
    failing episodes pay nothing: otherwise failing fast would be rewarded over failing after trying.
    """
    if only_passed and stats.passed is not True:
        return 0.0
    s = scale
    if task and task.get("expected_tokens") is not None:
        s = float(task["expected_tokens"])
    if not s > 0:
        raise ValueError(f"length scale (expected_tokens) must be > 0, got {s}")
    return 0.0 - min(coef * math.log1p(stats.completion_tokens / s), cap)


def malformed_penalty(stats: EpisodeStats, task: dict | None = None, *, per_call: float = 0.1,
                      cap: float = 0.5) -> float:
    """-min(per_call * malformed_tool_calls, cap), passing or not: a bad call costs a turn either way."""
    return 0.0 - min(per_call * stats.malformed_tool_calls, cap)


def parallelism_bonus(stats: EpisodeStats, task: dict | None = None, *, coef: float = 0.05,
                      cap: float = 0.1) -> float:
    """min(coef * (tool_calls_per_turn - 1), cap) for passing episodes that batch calls, else 0.

    Only when passed, so issuing many useless calls at once is never worth it on its own.
    """
    if stats.passed is not True or stats.tool_calls_per_turn <= 1:
        return 0.0
    return min(coef * (stats.tool_calls_per_turn - 1), cap)


def evidence_penalty(stats: EpisodeStats, task: dict | None = None, *, per_unsupported: float = 0.1,
                     per_contradicted: float = 0.2, cap: float = 0.3) -> float:
    """-min(per_unsupported * unsupported + per_contradicted * contradicted, cap), passing or not.

    Charged to passing episodes too: "the tests pass" said without running them is the habit to unlearn,
    and it is as unsupported when the hidden tests happen to pass. An answer without claims pays nothing;
    saying what was not checked ("I did not run the tests") is not a claim."""
    return 0.0 - min(per_unsupported * stats.unsupported_claims + per_contradicted * stats.contradicted_claims, cap)


def turn_cost(stats: EpisodeStats, task: dict | None = None, *, per_turn: float = 0.0, free: float = 0.0,
              cap: float = 0.1, only_passed: bool = True) -> float:
    """-min(per_turn * max(0, turns - free), cap): each model turn is a round trip (latency, a re-read
    prompt). Passing episodes only by default, for the reason length_penalty gives."""
    if only_passed and stats.passed is not True:
        return 0.0
    return 0.0 - min(per_turn * max(0.0, stats.turns - free), cap)


def call_cost(stats: EpisodeStats, task: dict | None = None, *, per_call: float = 0.0, cap: float = 0.05,
              only_passed: bool = True) -> float:
    """-min(per_call * tool_calls, cap): a call costs its run time and the context its output fills,
    batched or not (so with the parallelism bonus, batching is rewarded, piling on calls is not)."""
    if only_passed and stats.passed is not True:
        return 0.0
    return 0.0 - min(per_call * stats.tool_calls, cap)


# -- configuration --------------------------------------------------------------------------------------------

@dataclass
class RewardConfig:
    pass_weight: float = 1.0
    """Reward for a verified pass."""
    length_coef: float = 0.1
    """coef of length_penalty; 0 turns it off."""
    length_scale: float = 1000.0
    """Tokens scale of length_penalty for tasks without "expected_tokens"."""
    length_cap: float = 0.5
    """Largest length penalty; must stay below pass_weight so that passing always beats failing."""
    length_only_passed: bool = True
    """Charge length to passing episodes only (charging failures rewards giving up early)."""
    malformed_per_call: float = 0.1
    """Penalty per malformed tool call; 0 turns it off."""
    malformed_cap: float = 0.5
    """Largest malformed-call penalty per episode."""
    parallel_coef: float = 0.0
    """Bonus per extra call per calling turn beyond one; off by default."""
    parallel_cap: float = 0.1
    """Largest parallelism bonus."""
    evidence_unsupported: float = 0.1
    """Penalty per claim of the final answer the tool log does not show (agent/tasks/claims.py); 0 turns it off."""
    evidence_contradicted: float = 0.2
    """Penalty per claim the tool log shows false; 0 turns it off."""
    evidence_cap: float = 0.3
    """Largest evidence penalty per episode."""
    evidence_on_claims: bool = True
    """RL credits the evidence penalty to the tokens of the false claims alone, as their advantage (baseline
    0, the pass reward's advantage withheld from them), and leaves it out of the episode's group-relative
    advantage (train/claim_credit.py); false: folded into the episode's reward like the other terms."""
    evidence_claim_weight: float = 3.0
    """With evidence_on_claims, the claim tokens' advantage is this times the evidence penalty: 3 puts a
    contradicted claim (0.2) at -0.6, about a failed episode's advantage in a group that half passes."""
    turn_cost: float = 0.0
    """Cost per model turn beyond `free_turns`; off by default."""
    free_turns: float = 0.0
    """Turns that cost nothing (a task needs some)."""
    turn_cap: float = 0.1
    """Largest turn cost (with the length and evidence caps, below pass_weight)."""
    call_cost: float = 0.0
    """Cost per tool call; off by default."""
    call_cap: float = 0.05
    """Largest tool-call cost."""
    efficiency_only_passed: bool = True
    """Charge turn and call costs to passing episodes only (charging failures rewards giving up early)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(f.default, bool):
                if not isinstance(v, bool):
                    raise ValueError(f"reward config {f.name} must be true or false, got {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"reward config {f.name} must be a finite number >= 0, got {v!r}")
            setattr(self, f.name, float(v))
        if not self.length_scale > 0:
            raise ValueError(f"reward config length_scale must be > 0, got {self.length_scale}")
        if self.length_coef > 0 and self.length_cap >= self.pass_weight:
            raise ValueError(f"reward config length_cap ({self.length_cap}) must be below pass_weight "
                             f"({self.pass_weight}), or a long pass could score no better than a failure")
        # what a pass can be charged for its manner (not its mistakes) must leave it above any failure
        manner = {"length_cap": self.length_cap if self.length_coef > 0 else 0.0,
                  "evidence_cap": self.evidence_cap if self.evidence_unsupported or self.evidence_contradicted else 0.0,
                  "turn_cap": self.turn_cap if self.turn_cost > 0 else 0.0,
                  "call_cap": self.call_cap if self.call_cost > 0 else 0.0}
        if sum(manner.values()) and sum(manner.values()) >= self.pass_weight:
            on = " + ".join(f"{k} {v}" for k, v in manner.items() if v)
            raise ValueError(f"reward config {on} = {sum(manner.values())} must be below pass_weight "
                             f"({self.pass_weight}), or a pass could score no better than a failure")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RewardConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown reward config keys {unknown}; known: {sorted(known)}")
        return cls(**d)


Reward = Callable[[EpisodeStats, dict | None], tuple[float, dict[str, float]]]


def compose(cfg: RewardConfig) -> Reward:
    """(stats, task) -> (total, {component: value}); raises on infra-error episodes (mask them out)."""

    def reward(stats: EpisodeStats, task: dict | None = None) -> tuple[float, dict[str, float]]:
        if stats.infra_error:
            raise ValueError(f"episode ended in an infrastructure failure (status {stats.status!r}): "
                             "mask it out of training rather than scoring it")
        parts = {
            "pass": cfg.pass_weight * pass_reward(stats, task),
            "length": length_penalty(stats, task, coef=cfg.length_coef, scale=cfg.length_scale,
                                     cap=cfg.length_cap, only_passed=cfg.length_only_passed),
            "malformed": malformed_penalty(stats, task, per_call=cfg.malformed_per_call, cap=cfg.malformed_cap),
            "parallel": parallelism_bonus(stats, task, coef=cfg.parallel_coef, cap=cfg.parallel_cap),
            "evidence": evidence_penalty(stats, task, per_unsupported=cfg.evidence_unsupported,
                                         per_contradicted=cfg.evidence_contradicted, cap=cfg.evidence_cap),
            "turns": turn_cost(stats, task, per_turn=cfg.turn_cost, free=cfg.free_turns, cap=cfg.turn_cap,
                               only_passed=cfg.efficiency_only_passed),
            "calls": call_cost(stats, task, per_call=cfg.call_cost, cap=cfg.call_cap,
                               only_passed=cfg.efficiency_only_passed),
        }
        return sum(parts.values()), parts

    return reward
