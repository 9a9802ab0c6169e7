"""Request bodies of the OpenAI-compatible API, validated, plus the OpenAI error shape.

Unknown fields are accepted and ignored (clients send many), wrong types (no coercion: `true` is not 1)
and out-of-range values are 400s. vLLM's extensions that training needs are here too: `return_token_ids`, `stop_token_ids`,
`top_k`, `chat_template_kwargs`. The models are also the OpenAPI schema, so what they accept is what
/openapi.json promises: a message's required content is per role, not a validator the schema cannot show.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from jsonschema import SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, field_validator

# JSON may spell a lone UTF-16 surrogate ("\ud800"); no UTF-8 text can hold one, so the tokenizer cannot.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _whole(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def Int(**limits: Any) -> Any:  # noqa: N802 - used as a type
    """An integer as JSON Schema means it: 7.0 is one (schema-driven clients send it), true and "7" are not
    (strict models). The limits go before the validator, else pydantic writes them into the OpenAPI schema
    as unknown `ge`/`le` keys instead of minimum/maximum."""
    return Annotated[int, Field(**limits), BeforeValidator(_whole)]


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error body: every 4xx and 5xx of this server (the OpenAPI schema says so)."""

    error: ErrorDetail


class _Lenient(BaseModel):
    """Unknown keys pass; known ones must have their JSON type: strict, so `true` is not token id 1 and
    "0.5" is not a temperature (what the schema promises is what is accepted)."""

    model_config = ConfigDict(extra="allow", strict=True)


class FunctionSpec(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """OpenAI's rule: a JSON Schema of an object. Templates and the tool-call parser read `properties`."""
        if v is None:
            return v
        try:
            validator_for(v).check_schema(v)
        except SchemaError as e:
            raise ValueError(f"not a valid JSON Schema: {e.message}") from None
        if v.get("type", "object") != "object":
            raise ValueError(f"must be a JSON Schema of type \"object\", not {v.get('type')!r}")
        return v


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


Content = str | list[dict[str, Any]]  # text, or OpenAI's content parts (the text ones are kept)


class _Message(_Lenient):
    name: str | None = None


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallIn] | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content | None = None  # OpenAI accepts a tool result without content: it renders as ""
    tool_call_id: str | None = None


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class StreamOptions(_Lenient):
    include_usage: bool = False


class _NoSurrogates(_Lenient):
    @field_validator("*", mode="before")
    @classmethod
    def _no_lone_surrogates(cls, v: Any) -> Any:
        if _has_surrogate(v):
            raise ValueError("contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode text")
        return v


class _Sampling(_NoSurrogates):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: Int(ge=-1) | None = None
    max_tokens: Int(ge=1) | None = None
    stop: str | list[str] | None = None
    seed: Int(ge=-(2**63), le=2**64 - 1) | None = None  # what torch's generators take
    n: Int(ge=1, le=16) = 1
    stop_token_ids: list[Int()] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class JSONSchemaSpec(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    """None: any JSON object."""
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            try:
                validator_for(v).check_schema(v)
            except SchemaError as e:
                raise ValueError(f"not a valid JSON Schema: {e.message}") from None
        return v


class TextFormat(_Lenient):
    type: Literal["text"]


class JSONObjectFormat(_Lenient):
    type: Literal["json_object"]


class JSONSchemaFormat(_Lenient):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: Int(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=20) | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    return_routed_experts: bool = False
    """Per choice, the MoE experts of every token the model read (serve/routed_experts.py)."""


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int()] | list[list[Int()]]
    echo: bool = False
    max_tokens: Int(ge=1) | None = 16
    logprobs: Int(ge=0, le=20) | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "The prompt is empty: it has no tokens to continue from.", param="prompt",
                           code="empty_prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TokenizeCompletionRequest(_NoSurrogates):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_NoSurrogates):
    """POST /tokenize with messages: the ids /v1/chat/completions would use as its prompt (vLLM's shape)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[Int()]


class LoadWeightsRequest(BaseModel):
    """POST /v1/load_weights. Unlike the OpenAI bodies, unknown keys are refused: a misspelt
    `abort_in_flight` silently ignored would change what happens to requests in flight."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)
    policy_version: StrictInt | None = Field(default=None, ge=0)
    abort_in_flight: StrictBool = False


def _has_surrogate(v: Any) -> bool:
    """Whether any string in a JSON value (keys included) holds a lone surrogate."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if _SURROGATE.search(x):
                return True
        elif isinstance(x, dict):
            stack += x.keys()
            stack += x.values()
        elif isinstance(x, list):
            stack += x
    return False


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
