"""Request bodies of the OpenAI-compatible API, validated, plus the OpenAI error shape.

Unknown fields are accepted and ignored (clients send many), wrong types and out-of-range values are
400s. vLLM's extensions that training needs are here too: `return_token_ids`, `stop_token_ids`,
`top_k`, `chat_template_kwargs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionSpec(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(_Lenient):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.role in ("system", "developer", "user", "tool") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class LoadWeightsRequest(BaseModel):
    """POST /v1/load_weights. Unlike the OpenAI bodies, unknown keys are refused: a misspelt
    `abort_in_flight` silently ignored would change what happens to requests in flight."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)
    policy_version: StrictInt | None = Field(default=None, ge=0)
    abort_in_flight: StrictBool = False


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line from pydantic's errors, and the top-level field it is about."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", None
    if first.get("type") == "missing":
        return (f"{where} is required", param) if where else ("the request has no JSON body", None)
    if not where and first.get("type") in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    return (f"{where}: {msg}" if where else msg), param
