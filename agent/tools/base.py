"""The tool contract: a tool is a typed function with a docstring; its JSON schema is derived from both.

A handler looks like::

    @tool(parallel_safe=True)
    def read_file(ctx: ToolContext, path: str, offset: Annotated[int, {"minimum": 1}] = 1) -> ToolResult:
        '''First line and paragraph: the description the model sees.

        Args:
            path: What the model is told about `path`.
            offset: ...
        '''

Parameter names, types and descriptions become the tool's `parameters` schema (JSON Schema, the shape
OpenAI-compatible servers expect). Supported annotations: str, int, float, bool, Literal[...],
list[X], TypedDict, `X | None` (optional), and `Annotated[X, {extra schema}]` for constraints.
Parameters without a default are required. Tool names and parameter names are a public contract:
models are trained on them.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin


class ToolError(Exception):
    """An error the model should see and can act on (bad path, no match, ...). Never fatal."""


@dataclass
class ToolResult:
    """What a tool call produced.

    `content` is exactly what the model sees. `data` carries structured details for front-ends
    (a diff, an exit code, hits) and is never sent to the model.
    """

    content: str
    ok: bool = True
    data: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0  # the call's own time: waiting for the person's approval is not in it
    approval_s: float = 0.0  # how long the call waited for the person's approval

    @classmethod
    def error(cls, message: str, **data: Any) -> ToolResult:
        return cls(content=f"Error: {message}", ok=False, data=data)


@dataclass(frozen=True)
class Tool:
    """One tool: its public spec and its handler, defined together."""

    name: str
    description: str
    parameters: dict[str, Any]
    handler: Callable[..., ToolResult]
    parallel_safe: bool
    # Tools that change the workspace or run commands: refused in read-only mode, asked for in `ask` mode.
    mutates: bool

    def spec(self) -> dict[str, Any]:
        """The OpenAI chat-completions `tools` entry for this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def tool(*, parallel_safe: bool, mutates: bool = False, name: str | None = None):
    """Turn a typed, documented function into a `Tool`."""

    def wrap(fn: Callable[..., ToolResult]) -> Tool:
        description, params = _parse_docstring(inspect.getdoc(fn) or "")
        return Tool(
            name=name or fn.__name__,
            description=description,
            parameters=_schema_for_function(fn, params),
            handler=fn,
            parallel_safe=parallel_safe,
            mutates=mutates,
        )

    return wrap


_ARG_LINE = re.compile(r"^(\w+)\s*(?:\([^)]*\))?:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {param: description})."""
    lines = doc.splitlines()
    desc_lines: list[str] = []
    params: dict[str, str] = {}
    i = 0
    while i < len(lines) and lines[i].strip() not in ("Args:", "Arguments:"):
        desc_lines.append(lines[i])
        i += 1
    current: str | None = None
    arg_indent: int | None = None
    for line in lines[i + 1 :]:
        if not line.strip():
            current = None
            continue
        indent = len(line) - len(line.lstrip())
        if arg_indent is None:
            arg_indent = indent
        m = _ARG_LINE.match(line.strip())
        if indent == arg_indent and m:
            current = m.group(1)
            params[current] = m.group(2).strip()
        elif current is not None and indent > arg_indent:
            params[current] = (params[current] + " " + line.strip()).strip()
        elif indent < arg_indent:
            break
    paragraphs = "\n".join(desc_lines).strip().split("\n\n")
    description = "\n\n".join(" ".join(ln.strip() for ln in p.splitlines()) for p in paragraphs)
    return description, params


def _schema_for_function(fn: Callable[..., Any], docs: dict[str, str]) -> dict[str, Any]:
    hints = typing.get_type_hints(fn, include_extras=True)
    sig = inspect.signature(fn)
    props: dict[str, Any] = {}
    required: list[str] = []
    for i, (pname, param) in enumerate(sig.parameters.items()):
        if i == 0:  # the ToolContext
            continue
        if pname not in docs:
            raise TypeError(f"{fn.__name__}: parameter {pname!r} is not documented in Args:")
        schema = schema_for_type(hints[pname])
        schema["description"] = docs[pname]
        props[pname] = schema
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def schema_for_type(tp: Any) -> dict[str, Any]:
    """JSON Schema for one Python annotation (the subset tools use)."""
    origin = get_origin(tp)
    if origin is typing.Annotated:
        base, *extras = get_args(tp)
        schema = schema_for_type(base)
        for extra in extras:
            if isinstance(extra, dict):
                schema.update(extra)
        return schema
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {tp!r}")
        return schema_for_type(args[0])
    if origin is Literal:
        values = list(get_args(tp))
        return {"type": _json_type(type(values[0])), "enum": values}
    if origin is list:
        (item,) = get_args(tp)
        return {"type": "array", "items": schema_for_type(item)}
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp, include_extras=True)
        required = sorted(getattr(tp, "__required_keys__", hints.keys()))
        return {
            "type": "object",
            "properties": {k: schema_for_type(v) for k, v in hints.items()},
            "required": [k for k in hints if k in required],
            "additionalProperties": False,
        }
    return {"type": _json_type(tp)}


def _json_type(tp: Any) -> str:
    mapping = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if tp not in mapping:
        raise TypeError(f"unsupported parameter type {tp!r}")
    return mapping[tp]
