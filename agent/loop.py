"""The agent loop: messages → model (streamed) → tool calls → executor → tool messages → repeat.

One loop for every front-end (TUI, line mode, headless) and for RL rollouts. It stops when the model
answers without tool calls, or at a limit (turns, wall time, tokens), or on interrupt, or when an answer
is cut off after its tool calls started (status "error"; the calls' results are kept). An answer is
never a tool call the parser could not read (in the content or the reasoning): the model is told what
could not be parsed and asked again, `malformed_retries` times in a row, then the run ends with status
"error", error_kind "malformed_tool_call". An empty answer ends with status "no_answer", not "completed". It emits the
events of agent.protocol and writes the trajectory as it goes. Errors the model can act on are tool
observations (the executor's job); errors it cannot (auth, unreachable server) end the run with
status "error".

Modes (ask / plan / code) are decided here, in the tool policy every call passes through, not by the
prompt: in ask and plan no tool that mutates (writes, edits, shell, MCP tools not marked read-only) runs,
whatever the front-end and whatever the approval mode; the prompt only tells the model why.

Tool calls start while the model is still streaming: each call is submitted to the executor as soon
as the client has it whole, and the executor keeps them in order around writers.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from agent.client import Model, ModelError, ModelTurn, StreamCallbacks, estimate_tokens, routes_from
from agent.config import Config
from agent.context import compact, estimate_messages, prompt_text, summary_request
from agent.protocol import (
    AssistantMessage,
    Event,
    Finished,
    Message,
    ModeChanged,
    Notice,
    ReasoningDelta,
    Retrying,
    Summarized,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
    TurnStarted,
    UsageReport,
    tool_call_message,
)
from agent.session import Session
from agent.toolcall_text import unparsed_calls
from agent.tools import Executor, Registry, Tool, ToolCall, ToolContext, ToolResult
from agent.tools.executor import Approver

UNPARSED = ("Your last message contains a tool call that could not be parsed, starting {start!r}, so no tool "
            "ran. Write each tool call in the tool-call format (one call per block, its arguments a JSON object "
            "that fits the tool's parameters), or answer in plain text without one.")
MODES = ("code", "ask", "plan")
MODE_REFUSAL = ("Refused: this session is in {mode} mode, where no file is written and no command runs, so {name} "
                "is not allowed. Use read-only tools (read_file, grep, glob, list_dir, semantic_search) and "
                "{then}.")
MODE_THEN = {"ask": "answer the question", "plan": "finish with the plan as a todo list (todo_write)"}


class Agent:
    def __init__(self, model: Model, registry: Registry, ctx: ToolContext, config: Config, session: Session, *,
                 context_window: int, emit: Callable[[Event], None] = lambda e: None,
                 approve: Approver | None = None, messages: list[Message] | None = None):
        self.model, self.registry, self.ctx, self.config = model, registry, ctx, config
        self.session, self.window, self.emit = session, context_window, emit
        self.specs = registry.specs()
        self.spec_hash = registry.spec_hash()
        self.messages: list[Message] = list(messages or [])
        self.cancel = threading.Event()
        self.approve = approve
        self.mode = "code"
        self.executor = Executor(registry, ctx, approve=self._policy, on_start=self._started,
                                 on_finish=self._finished)
        self.turn = 0
        self.prompt_tokens = self.completion_tokens = 0
        self._last_prompt = (0, 0)  # (prompt tokens reported, number of messages they covered)
        self._summarized_at = -1
        self.error_kind: str | None = None
        self._recorded: list[int] = []  # prompt + completion ids of the last request recorded (record_tokens)

    # -- public ---------------------------------------------------------------------------------------

    def run(self, task: str, system: str | None = None) -> Finished:
        start = time.monotonic()
        self.cancel.clear()
        self.ctx.cancel.clear()
        self.error_kind = None
        if not self.messages:
            self._append({"role": "system", "content": system or ""})
        if self.mode != "code":  # why its tools are limited, so it does not waste turns on refusals
            task = prompt_text(f"mode_{self.mode}.md").strip() + "\n\n" + task
        self._append({"role": "user", "content": task})
        status, final, error = "completed", "", None
        turns_at_start, tokens_at_start = self.turn, self.prompt_tokens + self.completion_tokens
        unparsed_turns = 0
        try:
            while True:
                if self.cancel.is_set():
                    status = "interrupted"
                    break
                limit = self._limit_hit(start, turns_at_start, tokens_at_start)
                if limit:
                    status = limit
                    break
                if (self._context_used() >= self.config.summarize_at * self.window
                        and self._summarized_at != self.turn):
                    self._summarize()
                cap = self._max_tokens(tokens_at_start)
                if cap is not None and cap < 1:  # the budget cannot pay for the prompt: no request
                    status = "max_tokens"
                    break
                reply = self._model_turn(max_tokens=cap)
                if reply.tool_calls:
                    unparsed_turns = 0
                    continue
                attempts = unparsed_calls(reply.content) + unparsed_calls(reply.reasoning)
                if attempts:
                    unparsed_turns += 1
                    if unparsed_turns > self.config.malformed_retries:
                        status, error, self.error_kind = "error", (
                            f"the model wrote a tool call that could not be parsed {unparsed_turns} turns in a "
                            f"row ({attempts[0]!r}…)"), "malformed_tool_call"
                        break
                    self._append({"role": "user", "content": UNPARSED.format(start=attempts[0])})
                    self.emit(Notice("warning", f"Tool call not parsed ({attempts[0]!r}…): the model is asked again."))
                    continue
                final = reply.content
                if cap is not None and reply.finish_reason == "length":
                    # Cut short by max_tokens (the configured cap or what the budget had left): a
                    # truncated answer is not a completed one.
                    status = "max_tokens"
                elif not final.strip():
                    status = "no_answer"
                break
        except ModelError as e:
            status, error = ("interrupted", None) if e.kind == "interrupted" else ("error", str(e))
            self.error_kind = e.kind
        finished = Finished(status, final, self.turn - turns_at_start, time.monotonic() - start,
                            self.prompt_tokens, self.completion_tokens, self.session.id, error,
                            self.error_kind if status == "error" else None, self.config.builtin_model)
        self.session.write({"type": "finished", **{k: v for k, v in finished.to_dict().items() if k != "type"}})
        self.emit(finished)
        return finished

    def compact(self) -> bool:
        """Summarise the conversation now (/compact); False when there is nothing to summarise."""
        if len(self.messages) < 3:
            return False
        self._summarize()
        return True

    def set_mode(self, mode: str) -> None:
        """Switch between code, ask and plan; takes effect for the next tool call, even mid-turn."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
        if mode != self.mode:
            self.mode = mode
            # Recorded so that a resumed session starts in it (agent.runtime.build reads it back).
            self.session.write({"type": "mode", "mode": mode, "at": time.time()})
            self.emit(ModeChanged(mode))

    def plan_ready(self, finished: Finished) -> list[dict[str, Any]]:
        """The plan a plan-mode turn ended with (its todo list), for the front-end to offer; [] if none."""
        if self.mode != "plan" or finished.status != "completed":
            return []
        return list(self.ctx.todos)

    def accept_plan(self) -> str:
        """The user accepted the plan: switch to code and return the task that carries it out."""
        self.set_mode("code")
        return prompt_text("plan_accepted.md").strip()

    def interrupt(self) -> None:
        """Stop the stream and kill running tools; the session stays consistent."""
        self.cancel.set()
        self.executor.cancel()
        interrupt = getattr(self.model, "interrupt", None)
        if interrupt:
            interrupt()

    # -- one turn -------------------------------------------------------------------------------------

    def _max_tokens(self, tokens_at_start: int) -> int | None:
        """The request's max_tokens: the configured one, capped by what the token budget has left once
        this prompt is paid for (None: no limit of ours)."""
        c = self.config
        if c.token_budget is None:
            return c.max_output_tokens
        used = self.prompt_tokens + self.completion_tokens - tokens_at_start
        left = c.token_budget - used - self._context_used()
        return left if c.max_output_tokens is None else min(left, c.max_output_tokens)

    def _model_turn(self, retried_overflow: bool = False, max_tokens: int | None = None) -> ModelTurn:
        self.turn += 1
        turn = self.turn
        self.emit(TurnStarted(turn))
        pending = self.executor.turn()
        calls: list[ToolCall] = []

        def on_call(call: ToolCall) -> None:
            calls.append(call)
            pending.submit(call)

        cb = StreamCallbacks(
            on_text=lambda t: self.emit(TextDelta(turn, t)),
            on_reasoning=lambda t: self.emit(ReasoningDelta(turn, t)),
            on_tool_call=on_call,
            on_retry=lambda attempt, delay, why: self.emit(Retrying(turn, attempt, delay, why)),
        )
        sent = self.session.sent_count()
        # max_tokens only when it differs from the model's own setting: a Model may not take the argument.
        extra = {"max_tokens": max_tokens} if max_tokens != self.config.max_output_tokens else {}
        try:
            reply = self.model.complete(self.messages, self.specs, cb, self.cancel, **extra)
        except ModelError as e:
            if e.kind == "context_overflow" and not retried_overflow and not calls:
                self.turn -= 1
                self._summarize()
                return self._model_turn(retried_overflow=True, max_tokens=max_tokens)
            if e.kind in ("interrupted", "cut_off") and e.partial is not None:
                # Calls already running finish and are recorded, so the session can be resumed.
                self._assistant(turn, sent, e.partial, calls)
                self._tool_results(turn, calls, pending.results())
            raise
        for call in reply.tool_calls:  # a model that returned calls without announcing them
            if all(c.id != call.id for c in calls):
                on_call(call)
        self._assistant(turn, sent, reply, calls)
        self._tool_results(turn, calls, pending.results() if calls else [])
        return reply

    def _assistant(self, turn: int, sent: int, reply: ModelTurn, calls: list[ToolCall]) -> None:
        assistant: Message = {"role": "assistant", "content": reply.content}
        if reply.reasoning and self.config.record_tokens:
            # Sent back so the chat template renders the turn as it was sampled (append-only token
            # chains for training). Off in ordinary use: some APIs reject reasoning in requests.
            assistant["reasoning_content"] = reply.reasoning
        if calls:
            assistant["tool_calls"] = [tool_call_message(c.id, c.name, c.arguments) for c in calls]
        self.session.write({
            "type": "request", "turn": turn, "segment": self.session.segment, "messages": sent, "extra": [],
            "purpose": "turn", "spec_hash": self.spec_hash, "usage": _usage(reply),
            "timings": {"ttft_s": round(reply.ttft_s, 4), "model_s": round(reply.duration_s, 4)},
            "finish_reason": reply.finish_reason, "reasoning": reply.reasoning, **self._tokens(reply),
        })
        context_before = self._context_used()
        self._append(assistant)
        self.emit(AssistantMessage(turn, reply.content, assistant.get("tool_calls", [])))
        self._account(reply, sent, context_before)

    def _tool_results(self, turn: int, calls: list[ToolCall], results: list[ToolResult]) -> None:
        for call, result in zip(calls, results, strict=True):
            self._append({"role": "tool", "tool_call_id": call.id, "content": result.content})
        if calls:
            self.session.write({"type": "tools", "turn": turn, "calls": [
                {"id": c.id, "name": c.name, "ok": r.ok, "duration_s": round(r.duration_s, 4)}
                for c, r in zip(calls, results, strict=True)]})

    def _account(self, reply: ModelTurn, sent: int, context_before: int) -> None:
        u = reply.usage
        self.prompt_tokens += u.prompt_tokens
        self.completion_tokens += u.completion_tokens
        prompt = u.prompt_tokens
        if u.estimated and self._last_prompt[0]:
            # An interrupted request has no usage, only a 4-characters-a-token estimate of the whole
            # prompt, tool specs included, which can be several times the real count (a tokenizer with
            # long tokens, a template that renders the specs compactly). The server's last real figure
            # plus an estimate of the messages since is closer: it replaces the estimate.
            prompt = context_before
        self._last_prompt = (prompt + u.completion_tokens, sent + 1)
        gen_s = reply.duration_s - reply.ttft_s
        # A speed needs tokens streamed over a measurable time: none when the turn ended before them.
        speed = round(u.completion_tokens / gen_s, 2) if gen_s > 0.001 and u.completion_tokens else 0.0
        self.emit(UsageReport(self.turn, prompt, u.completion_tokens, self.prompt_tokens,
                              self.completion_tokens, self.window, round(reply.ttft_s, 4), speed, u.estimated,
                              u.cached_tokens))

    # -- tools' policy and events --------------------------------------------------------------------------------

    def _policy(self, call: ToolCall, tool: Tool, args: dict[str, Any]) -> str | None:
        """None to run the call, else the refusal the model sees. The mode first: in ask and plan no
        mutating tool runs, so no question is asked either; then the front-end's approvals."""
        if tool.mutates and self.mode != "code":
            return MODE_REFUSAL.format(mode=self.mode, name=tool.name, then=MODE_THEN[self.mode])
        return self.approve(call, tool, args) if self.approve is not None else None

    def _started(self, index: int, call: ToolCall) -> None:
        try:
            args: Any = json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments
        except json.JSONDecodeError:
            args = call.arguments
        self.emit(ToolCallStarted(self.turn, index, call.id, call.name, args))

    def _finished(self, index: int, call: ToolCall, result: ToolResult) -> None:
        self.emit(ToolCallFinished(self.turn, index, call.id, call.name, result.ok, result.content,
                                   round(result.duration_s, 4), result.data))

    # -- context --------------------------------------------------------------------------------------

    def _context_used(self) -> int:
        tokens, covered = self._last_prompt
        if not tokens:
            return estimate_messages(self.messages) + estimate_tokens(self.specs)
        return tokens + estimate_messages(self.messages[covered:])

    def _tokens(self, reply: ModelTurn) -> dict[str, Any]:
        """The sampled tokens (record_tokens), for training on exactly them; nothing otherwise. Routed
        experts are kept from the first position the previous request did not already cover, when this
        prompt continues it (what train/samples.py chains into one sample)."""
        t = reply.tokens
        if t is None:
            return {}
        out = {"prompt_token_ids": t.prompt_token_ids, "completion_token_ids": t.completion_token_ids,
               "completion_logprobs": t.completion_logprobs, "policy_version": t.policy_version}
        if t.numerics is not None:  # serve_dtype, batch_invariant: what the trainer scores these tokens in
            out |= t.numerics
        if t.routed_experts is not None:
            prev = self._recorded
            start = len(prev) - 1 if prev and t.prompt_token_ids[: len(prev)] == prev else 0
            out["routed_experts"] = routes_from(t.routed_experts, start)
        self._recorded = t.prompt_token_ids + t.completion_token_ids
        return out

    def _summarize(self) -> None:
        before = self._context_used()
        request = summary_request(self.messages, self.window)
        sent = self.session.sent_count()
        reply = self.model.complete(request, None, StreamCallbacks(), self.cancel)
        unchanged = request[:-1] == self.messages
        self.session.write({
            "type": "request", "turn": self.turn, "segment": self.session.segment,
            "messages": sent if unchanged else 0, "extra": request[-1:] if unchanged else request,
            "purpose": "summary", "spec_hash": None, "usage": _usage(reply),
            "timings": {"ttft_s": round(reply.ttft_s, 4), "model_s": round(reply.duration_s, 4)},
            "finish_reason": reply.finish_reason, "reasoning": reply.reasoning, **self._tokens(reply),
        })
        self.prompt_tokens += reply.usage.prompt_tokens
        self.completion_tokens += reply.usage.completion_tokens
        new = compact(self.messages, reply.content, self.window)
        self.session.new_segment(reply.content, before)
        self.messages = []
        for m in new:
            self._append(m)
        self._last_prompt = (0, 0)
        self._summarized_at = self.turn
        self.emit(Summarized(self.session.segment, reply.content, before, estimate_messages(self.messages)))

    def _append(self, message: Message) -> None:
        self.messages.append(message)
        self.session.add_message(message)

    def _limit_hit(self, start: float, turns_at_start: int, tokens_at_start: int) -> str | None:
        c = self.config
        if self.turn - turns_at_start >= c.max_turns:
            return "max_turns"
        if c.max_time_s is not None and time.monotonic() - start >= c.max_time_s:
            return "max_time"
        if c.token_budget is not None and self.prompt_tokens + self.completion_tokens - tokens_at_start >= c.token_budget:
            return "max_tokens"
        return None


def _usage(reply: ModelTurn) -> dict[str, Any]:
    u = reply.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "estimated": u.estimated,
            "cached_tokens": u.cached_tokens}
