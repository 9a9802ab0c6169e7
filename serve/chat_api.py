"""POST /v1/chat/completions: render with the chat template, generate, parse tool calls, answer.

tool_choice: "none" renders no tools and parses none; "auto" renders them and parses whatever the
model writes; "required" and a named function prefill the start of a tool call after the generation
prompt (`ChatFormat.forced_call_prefix`) and, on engines that sample under a grammar (native, hf), a
grammar (serve/structured.py) makes the rest a well-formed call of an offered tool (the named one)
with arguments valid against its schema, closed, so it comes back as `tool_calls`. `response_format`
json_object / json_schema constrains the answer to such JSON (with tools and tool_choice "auto": that
JSON or tool calls; with a forced tool_choice, the call wins). Engines without grammars answer a
response_format with a 400 and a forced call with the prefill alone.
parallel_tool_calls=false keeps the first call and stops generating after it.
Streaming emits content and reasoning deltas as they become certain and each tool call whole, as soon
as its closing tag arrives. Every body and chunk carries `policy_version`, the version of the weights
that generated the tokens; it is known once the engine has taken the request, so a stream's first
chunk (the role) waits for the first token. They also carry `serve_dtype` and `batch_invariant`
(serve/api.py `numerics`), which the agent records with each request for the trainer. A stream that fails ends with the error event, without
`[DONE]`, so a client cannot take it for a finished answer.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from serve import routed_experts
from serve.chat_format import ChatFormatError
from serve.engine.base import SamplingParams
from serve.generation import Finish, run_choice
from serve.schemas import APIError, ChatCompletionRequest, NamedToolChoice
from serve.state import ServerState, engine_error, request_id, unless_disconnected
from serve.structured import GrammarError

GRAMMAR_ENGINES = {"native", "hf"}  # engines whose sampling applies SamplingParams.grammar


@dataclass
class Prepared:
    prompt_text: str
    prefix: str
    prompt_ids: list[int]
    tools: list[dict[str, Any]] | None  # the tools rendered and parsed (None for tool_choice "none")
    params: SamplingParams
    stop: list[str]
    parallel: bool


@dataclass
class ChoiceOut:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str = "stop"
    completion_tokens: int = 0
    policy_version: int | None = None
    routed_experts: Any = None  # [T, M, K] (return_routed_experts)
    cached_tokens: int | None = None  # prompt tokens from the engine's prefix cache (None: not known)


def prepare(state: ServerState, req: ChatCompletionRequest) -> Prepared:
    state.check_model(req.model)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    forced: str | None = None
    if isinstance(choice, NamedToolChoice):
        names = [t["function"]["name"] for t in tools or []]
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                           param="tool_choice", code="invalid_tool_choice")
        forced = choice.function.name
    elif choice == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs at least one tool", param="tool_choice",
                       code="invalid_tool_choice")
    rendered_tools = tools if choice != "none" else None
    kwargs = req.chat_template_kwargs or {}
    if clash := sorted(set(kwargs) & state.chat.reserved_kwargs):
        raise APIError(400, f"chat_template_kwargs cannot set {', '.join(clash)}: the server sets them from the "
                            "request", param="chat_template_kwargs")
    try:
        prompt_text = state.chat.render(messages, rendered_tools, True, **kwargs)
    except ChatFormatError as e:
        raise APIError(400, str(e), param="chat_template_kwargs" if kwargs else "messages",
                       code="chat_template_error") from None
    prefix = state.chat.forced_call_prefix(forced) if (forced or choice == "required") else ""
    prompt_ids = state.encode(prompt_text + prefix, "messages")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="logprobs_required")
    params = state.sampling(req, len(prompt_ids), req.max_completion_tokens or req.max_tokens, req.logprobs,
                            req.top_logprobs or 0)
    grammar = _grammar(state, req, rendered_tools, forced, choice == "required")
    if grammar is not None:  # the grammar ends on a stop token: it must end the sequence (even with ignore_eos)
        params = replace(params, grammar=grammar,
                         stop_token_ids=sorted(set(params.stop_token_ids) | set(state.chat.stop_token_ids)))
    return Prepared(prompt_text, prefix, prompt_ids, rendered_tools, params, req.stop_list(), req.parallel_tool_calls)


def _grammar(state: ServerState, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None, forced: str | None,
             required: bool):
    """The grammar this request's answer must follow, or None (compiled here, on a prepare thread)."""
    fmt = req.response_format
    wants_json = fmt is not None and fmt.type != "text"
    if not (wants_json or forced or required):
        return None
    if state.engine.name not in GRAMMAR_ENGINES:
        if wants_json:
            raise APIError(400, f"response_format {fmt.type} needs structured decoding, which engine "
                                f"{state.engine.name} does not do", param="response_format", code="unsupported")
        return None  # forced calls: the prefill alone
    schema = fmt.json_schema.schema_ if wants_json and fmt.type == "json_schema" else None
    try:
        if forced or required:
            return state.grammars.forced_call(tools or [], forced, req.parallel_tool_calls)
        if tools:
            return state.grammars.calls_or_json(tools, schema, req.parallel_tool_calls)
        return state.grammars.json(schema)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_json_schema") from None


async def choice_events(state: ServerState, p: Prepared, params: SamplingParams,
                        stream_interval: int = 1) -> AsyncIterator[tuple[str, Any]]:
    """("content"|"reasoning", text), ("tool_call", dict), ("tokens", (ids, logprobs, tops, policy version)),
    ("finish", ChoiceOut). `stream_interval`: tokens gathered per piece after the first (run_choice)."""
    parser = state.chat.stream_parser(p.tools, parse_tools=p.tools is not None, prompt_text=p.prompt_text)
    out = ChoiceOut()
    pending = parser.feed(p.prefix) if p.prefix else []
    gen = run_choice(state.engine, state.chat.tokenizer, p.prompt_ids, params, p.stop, state.metrics,
                     stream_interval, state.chat.kept_special_ids(parser))
    stop_early = False
    try:
        async for piece in gen:
            if piece.policy_version is not None:
                out.policy_version = piece.policy_version
            if isinstance(piece, Finish):
                out.finish_reason, out.completion_tokens = piece.reason, piece.completion_tokens
                out.cached_tokens = piece.cached_tokens
                break
            if piece.routed_experts is not None:
                out.routed_experts = piece.routed_experts
            out.token_ids += piece.token_ids
            out.logprobs += piece.logprobs
            out.tops += piece.tops
            yield "tokens", (piece.token_ids, piece.logprobs, piece.tops, piece.policy_version)
            for item in pending + (parser.feed(piece.text) if piece.text else []):
                if stop_early:
                    break
                event, stop_early = _route(item, out, p.parallel)
                if event:
                    yield event
            pending = []
            if stop_early:
                out.completion_tokens = len(out.token_ids)
                break
    finally:
        await gen.aclose()
    for item in pending + parser.close():
        if stop_early:
            break
        event, stop_early = _route(item, out, p.parallel)
        if event:
            yield event
    if out.tool_calls:
        out.finish_reason = "tool_calls"
    yield "finish", out


def _route(item, out: ChoiceOut, parallel: bool) -> tuple[tuple[str, Any] | None, bool]:
    """Record a parsed item; returns (event to emit or None, whether to stop generating)."""
    if item.kind in ("content", "reasoning"):
        (out.content if item.kind == "content" else out.reasoning).append(item.text)
        return (item.kind, item.text), False
    if item.call is None or (out.tool_calls and not parallel):
        return None, not parallel
    call = {"id": "call_" + secrets.token_hex(8), "type": "function",
            "function": {"name": item.call.name, "arguments": item.call.arguments}}
    out.tool_calls.append(call)
    return ("tool_call", call), not parallel


def per_choice_params(params: SamplingParams, i: int) -> SamplingParams:
    return params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)


async def chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    p = await state.offload(prepare, state, req)
    rid, created = request_id("chatcmpl"), int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, req, p, rid, created, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    outs = await unless_disconnected(request, asyncio.gather(
        *(_collect(state, p, per_choice_params(p.params, i)) for i in range(req.n))))
    choices = []
    for i, out in enumerate(outs):
        message: dict[str, Any] = {"role": "assistant", "content": "".join(out.content).strip() if out.tool_calls
                                   else "".join(out.content)}
        if out.reasoning:
            message["reasoning_content"] = "".join(out.reasoning)
        if out.tool_calls:
            message["tool_calls"] = out.tool_calls
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": out.finish_reason,
                                  "logprobs": _logprobs(state, out.token_ids, out.logprobs, out.tops)
                                  if req.logprobs else None}
        if req.return_token_ids:
            choice["token_ids"] = out.token_ids
        if req.return_routed_experts:
            choice["routed_experts"] = _routes(out)
        choices.append(choice)
    completion = sum(o.completion_tokens for o in outs)
    body: dict[str, Any] = {"id": rid, "object": "chat.completion", "created": created, "model": state.served_name,
                            "policy_version": state.response_version([o.policy_version for o in outs]),
                            **state.numerics(),
                            "choices": choices,
                            "usage": usage(len(p.prompt_ids), completion, [o.cached_tokens for o in outs], req.n)}
    if req.return_token_ids:
        body["prompt_token_ids"] = p.prompt_ids
    state.metrics.requests.labels("/v1/chat/completions", "200").inc()
    return body


async def _collect(state: ServerState, p: Prepared, params: SamplingParams) -> ChoiceOut:
    out = ChoiceOut()
    async for kind, value in choice_events(state, p, params):
        if kind == "finish":
            out = value
    return out


def _routes(out: ChoiceOut) -> dict[str, Any] | None:
    if out.routed_experts is None:
        return None
    return routed_experts.encode(out.routed_experts.numpy(), 0)


def _logprobs(state: ServerState, ids: list[int], logprobs: list[float | None],
              tops: list[list[tuple[int, float]] | None]) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice (or of a stream chunk): one entry per token."""
    def entry(tid: int, lp: float | None) -> dict[str, Any]:
        text = state.chat.tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [entry(tid, lp) | {"top_logprobs": [entry(t, v) for t, v in (top or [])]}
                        for tid, lp, top in zip(ids, logprobs, tops, strict=False)]}


def usage(prompt: int, completion: int, cached: list[int | None] | None = None, n: int = 1) -> dict[str, Any]:
    """OpenAI's usage. `cached`: every choice's prompt tokens that came from the prefix cache; where each
    choice knows, they are reported as OpenAI and vLLM do (`prompt_tokens_details.cached_tokens`), counted
    like `prompt` (each prompt once: its n choices each prefill it, so their sum / n)."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached and None not in cached:
        out["prompt_tokens_details"] = {"cached_tokens": sum(cached) // n}
    return out


async def _stream(state: ServerState, req: ChatCompletionRequest, p: Prepared, rid: str, created: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.served_name,
            **state.numerics()}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return f"data: {json.dumps(base | {'choices': choices} | extra, ensure_ascii=False)}\n\n".encode()

    queue: asyncio.Queue = asyncio.Queue()
    cached: list[int | None] = []  # per finished choice (usage)

    async def produce(i: int) -> None:
        calls = 0
        announced = False  # the policy version of this choice's tokens, put on the queue at its first token
        ids: list[int] = []  # tokens since the last chunk (return_token_ids)
        pending: list[list] = [[], [], []]  # ids, logprobs, tops since the last chunk (logprobs)

        def chunk_logprobs() -> dict[str, Any] | None:
            if not req.logprobs or not pending[0]:
                return None
            lp = _logprobs(state, *pending)
            pending[:] = [[], [], []]
            return lp

        try:
            async for kind, value in choice_events(state, p, per_choice_params(p.params, i), state.stream_interval):
                if kind == "tokens":
                    if not announced:
                        announced = True
                        await queue.put(("version", value[3], 0))
                    ids += value[0]
                    for acc, new in zip(pending, value[:3], strict=True):
                        acc += new
                    continue
                if kind == "finish":
                    final = {"index": i, "delta": {}, "logprobs": chunk_logprobs(),
                             "finish_reason": value.finish_reason}
                    if req.return_token_ids:
                        final["token_ids"] = ids
                    if req.return_routed_experts:
                        final["routed_experts"] = _routes(value)
                    cached.append(value.cached_tokens)
                    await queue.put(("done", final, value.completion_tokens))
                    return
                if kind == "tool_call":
                    delta = {"tool_calls": [dict(value, index=calls)]}
                    calls += 1
                elif kind == "reasoning":
                    delta = {"reasoning_content": value}
                else:
                    delta = {"content": value}
                if kind != "tool_call" and not value:
                    continue
                c = {"index": i, "delta": delta, "logprobs": chunk_logprobs(), "finish_reason": None}
                if req.return_token_ids:
                    c["token_ids"], ids = ids, []
                await queue.put(("chunk", c, 0))
        except Exception as e:  # noqa: BLE001 - reported in-stream: headers are already sent
            await queue.put(("error", (engine_error(e), getattr(e, "policy_version", None)), 0))

    tasks = [asyncio.create_task(produce(i)) for i in range(req.n)]
    try:
        first: dict[str, Any] = {}
        if req.return_token_ids:
            first["prompt_token_ids"] = p.prompt_ids
        done, completion = 0, 0
        while done < req.n:
            kind, value, n = await queue.get()
            if kind == "error":  # the last event: no usage, no [DONE] (the answer is not complete)
                yield f"data: {json.dumps(value[0].body())}\n\n".encode()
                state.metrics.requests.labels("/v1/chat/completions", str(value[0].status)).inc()
                return
            if "policy_version" not in base:  # the first token of any choice: now the role chunk can go
                base["policy_version"] = state.response_version([value if kind == "version" else None])
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(req.n)], **first)
            if kind == "version":  # equal for all choices: an engine takes them in one go
                continue
            if kind == "done":
                done += 1
                completion += n
            yield chunk([value])
        if include_usage:
            yield chunk([], usage=usage(len(p.prompt_ids), completion, cached, req.n))
        yield b"data: [DONE]\n\n"
        state.metrics.requests.labels("/v1/chat/completions", "200").inc()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
