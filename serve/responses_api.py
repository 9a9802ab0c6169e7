"""POST /v1/responses: OpenAI's Responses API over the chat machinery (serve/chat_api.py), as vLLM serves it.

The request's `instructions` and `input` (a string, or items: messages with text parts, `function_call`s
and their `function_call_output`s; reasoning items are skipped) become chat messages, its function tools
chat tools, `max_output_tokens` max_tokens, `tool_choice` and `parallel_tool_calls` the same; then the
chat path renders, generates (grammar-forced calls included) and parses. The answer is a `response`
object whose `output` holds a reasoning item (when the model thought), a `message` item with the text
and one `function_call` item per call; `status` is "incomplete" (reason max_output_tokens) when the
answer was cut. With `stream: true` it is the Responses event stream: response.created, in_progress,
output items added, text and argument deltas, items done, then response.completed (or .incomplete), each
with its sequence_number.

Limits: nothing is stored (`store` is accepted and ignored), so `previous_response_id` is refused with a
400: send the whole conversation as `input`. Only function tools are offered to the model; others
(web_search, namespaces of tools) are accepted and left out. `text.format` json_schema / json_object map
to the chat API's response_format.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import Field, ValidationError, field_validator

from serve.chat_api import ChoiceOut, Prepared, choice_events, prepare, usage
from serve.schemas import (
    APIError,
    ChatCompletionRequest,
    FunctionSpec,
    Int,
    _Lenient,
    _NoSurrogates,
    validation_message,
)
from serve.state import ServerState, engine_error, unless_disconnected


class ResponsesTool(FunctionSpec):
    """A function tool (the Responses API's flat shape: name and parameters beside `type`)."""

    type: Literal["function"]
    strict: bool | None = None


class OtherTool(_Lenient):
    """A tool that is not a function (web_search, a namespace of tools, ...): accepted, not offered to the
    model (clients such as Codex CLI send them on every request)."""

    type: str

    @field_validator("type")
    @classmethod
    def _not_function(cls, v: str) -> str:
        if v == "function":
            raise ValueError("a function tool needs a name and a JSON Schema object as parameters")
        return v


class TextPart(_Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class NamedFunctionChoice(_Lenient):
    type: Literal["function"]
    name: str


class ResponsesRequest(_NoSurrogates):
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[ResponsesTool | OtherTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Int(ge=1) | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: Int(ge=-(2**63), le=2**64 - 1) | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    """Only its `format` of type json_object or json_schema is read (the chat API's response_format)."""
    metadata: dict[str, Any] | None = None


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request asks for (400 on what the chat API cannot express)."""
    if req.previous_response_id:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; send the "
                            "whole conversation as input", param="previous_response_id", code="unsupported_parameter")
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, InputMessage):
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # its text, then its calls: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        # reasoning items: skipped (the chat template renders a turn's own reasoning, if at all)
    if not messages:
        raise APIError(400, "input holds no message or function call to answer", param="input", code="empty_prompt")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "parallel_tool_calls": req.parallel_tool_calls}
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
             for t in req.tools or [] if isinstance(t, ResponsesTool)]
    if tools:
        body["tools"] = tools
    choice: Any = req.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    if choice is not None:
        body["tool_choice"] = choice
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
        body["response_format"] = ({"type": "json_object"} if fmt["type"] == "json_object" else
                                   {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}})
    for key in ("temperature", "top_p", "seed"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # what the Responses schema lets through and the chat API does not take
        message, param = validation_message(list(e.errors()))
        raise APIError(400, message, param=param, code="invalid_request") from None


# -- the answer -----------------------------------------------------------------------------------------


def _items(out: ChoiceOut, rid: str, status: str = "completed") -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if out.reasoning:
        items.append(_reasoning_item(rid, "".join(out.reasoning)))
    text = "".join(out.content).strip() if out.tool_calls else "".join(out.content)
    if text or not out.tool_calls:
        items.append(_message_item(_message_id(rid, 0), text, status))
    items += [_call_item(c, status) for c in out.tool_calls]
    return items


def _reasoning_item(rid: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _message_id(rid: str, n: int) -> str:
    """The n-th message item's id (a streamed answer opens another after a call when text follows it)."""
    return f"msg_{rid}" + (f"_{n}" if n else "")


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" or text
            else []}


def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def _response(state: ServerState, req: ResponsesRequest, rid: str, created: int, status: str,
              output: list[dict[str, Any]], use: dict[str, Any] | None) -> dict[str, Any]:
    body = {"id": f"resp_{rid}", "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": state.served_name,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
            "top_p": req.top_p,
            # a named choice as plain data: the stream json.dumps this body itself (FastAPI is not in the way)
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunctionChoice)
            else req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "metadata": req.metadata or {}, "usage": use, **state.numerics()}
    return body


def _usage(p: Prepared, out: ChoiceOut) -> dict[str, Any]:
    u = usage(len(p.prompt_ids), out.completion_tokens, [out.cached_tokens])
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


async def create_response(state: ServerState, req: ResponsesRequest, request: Request):
    chat = to_chat(req)
    p = await state.offload(prepare, state, chat)
    rid, created = secrets.token_hex(12), int(time.time())
    if req.stream:
        return StreamingResponse(_stream(state, req, p, rid, created), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def collect() -> ChoiceOut:
        out = ChoiceOut()
        async for kind, value in choice_events(state, p, p.params):
            if kind == "finish":
                out = value
        return out

    out = await unless_disconnected(request, collect())
    status = "incomplete" if out.finish_reason == "length" else "completed"
    state.metrics.requests.labels("/v1/responses", "200").inc()
    body = _response(state, req, rid, created, status, _items(out, rid), _usage(p, out))
    body["policy_version"] = state.response_version([out.policy_version])
    return body


async def _stream(state: ServerState, req: ResponsesRequest, p: Prepared, rid: str, created: int
                  ) -> AsyncIterator[bytes]:
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n".encode()

    shell = _response(state, req, rid, created, "in_progress", [], None)
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    output: list[dict[str, Any]] = []
    text_at: int | None = None  # output index of the open message item
    text: list[str] = []
    msg_id, messages = "", 0  # the open message item's id; message items opened so far
    # Whitespace that opens no message item yet: around tool calls it is dropped, as the non-streamed answer
    # strips it (parallel calls are separated by newlines, which used to open one repeated item per call).
    blank = ""
    reasoning: list[str] = []
    thought_at: int | None = None  # output index of the reasoning item (it comes first, as when not streamed)
    try:
        async for kind, value in choice_events(state, p, p.params, state.stream_interval):
            if kind == "content" and value:
                if text_at is None:
                    if not (blank + value).strip():
                        blank += value
                        continue
                    value, blank = blank + value, ""
                    text_at, text, msg_id, messages = len(output), [], _message_id(rid, messages), messages + 1
                    yield open_text(event, output, msg_id)
                text.append(value)
                yield event("response.output_text.delta", item_id=msg_id, output_index=text_at,
                            content_index=0, delta=value, logprobs=[])
            elif kind == "reasoning" and value:
                if thought_at is None:
                    thought_at = len(output)
                    output.append(_reasoning_item(rid, ""))
                    yield event("response.output_item.added", output_index=thought_at, item=output[thought_at])
                reasoning.append(value)
            elif kind == "tool_call":
                blank = ""
                if text_at is not None:
                    yield close_text(event, output, text_at, msg_id, "".join(text))
                    text_at = None
                item = _call_item(value, "in_progress") | {"arguments": ""}
                at = len(output)
                output.append(item)
                yield event("response.output_item.added", output_index=at, item=item)
                args = value["function"]["arguments"]
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=at, delta=args)
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                            arguments=args)
                output[at] = _call_item(value, "completed")
                yield event("response.output_item.done", output_index=at, item=output[at])
            elif kind == "finish":
                out = value
                if text_at is None and blank and not out.tool_calls:  # a blank answer, kept as when not streamed
                    text_at, text, msg_id = len(output), [blank], _message_id(rid, messages)
                    yield open_text(event, output, msg_id)
                    yield event("response.output_text.delta", item_id=msg_id, output_index=text_at,
                                content_index=0, delta=blank, logprobs=[])
                if text_at is not None:
                    yield close_text(event, output, text_at, msg_id, "".join(text))
                if thought_at is not None:
                    output[thought_at] = _reasoning_item(rid, "".join(reasoning))
                    yield event("response.output_item.done", output_index=thought_at, item=output[thought_at])
                if not output:  # nothing was said: still one (empty) message, as a non-streamed answer has
                    output.append(_message_item(_message_id(rid, 0), "", "completed"))
                status = "incomplete" if out.finish_reason == "length" else "completed"
                body = _response(state, req, rid, created, status, output, _usage(p, out))
                body["policy_version"] = state.response_version([out.policy_version])
                state.metrics.requests.labels("/v1/responses", "200").inc()
                yield event(f"response.{status}", response=body)
                return
    except APIError as e:
        yield event("error", code=e.code, message=e.message, param=e.param)
    except Exception as e:  # noqa: BLE001 - the engine's failure ends the stream with an error event
        err = engine_error(e)
        yield event("error", code=err.code, message=err.message, param=None)


def open_text(event, output: list[dict[str, Any]], item_id: str) -> bytes:
    """The events that open a message item at the end of `output` (one bytes chunk)."""
    at = len(output)
    output.append(_message_item(item_id, "", "in_progress"))
    return b"".join([
        event("response.output_item.added", output_index=at, item=output[at]),
        event("response.content_part.added", item_id=item_id, output_index=at, content_index=0,
              part={"type": "output_text", "text": "", "annotations": []}),
    ])


def close_text(event, output: list[dict[str, Any]], at: int, item_id: str, text: str) -> bytes:
    """The events that close the open message item (one bytes chunk)."""
    part = {"type": "output_text", "text": text, "annotations": []}
    output[at] = _message_item(item_id, text, "completed")
    return b"".join([
        event("response.output_text.done", item_id=item_id, output_index=at, content_index=0, text=text,
              logprobs=[]),
        event("response.content_part.done", item_id=item_id, output_index=at, content_index=0, part=part),
        event("response.output_item.done", output_index=at, item=output[at]),
    ])
