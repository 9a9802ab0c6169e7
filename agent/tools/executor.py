"""Running one assistant turn's tool calls: in parallel where safe, in order where not.

The rule is a read/write lock taken in call order. A `parallel_safe` call waits only for the last
writer before it; a writer waits for every call before it; calls after a writer wait for the writer.
Calls are handed to a FIFO thread pool in order, so they also *start* in order, and since every wait
points at an earlier call there is no deadlock. Results come back in call order whatever the finishing
order. Calls can be submitted one by one while the model is still streaming (`Turn.submit`).

Nothing here raises to the caller: an unknown tool, arguments that are not JSON or fail the schema, a
denied approval, a tool raising — each becomes an error observation the model can act on.
"""

from __future__ import annotations

import json
import logging
import re
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from agent.tools.base import Tool, ToolError, ToolResult
from agent.tools.context import ToolContext
from agent.tools.registry import Registry

log = logging.getLogger(__name__)

MAX_WORKERS = 16


@dataclass
class ToolCall:
    """A call as the model sent it: `arguments` is the raw JSON text (or an already-parsed dict)."""

    id: str
    name: str
    arguments: str | dict[str, Any]


# Returns None to allow the call, or the reason it was refused (shown to the model).
Approver = Callable[[ToolCall, Tool, dict[str, Any]], str | None]
StartHook = Callable[[int, ToolCall], None]
FinishHook = Callable[[int, ToolCall, ToolResult], None]


class Executor:
    def __init__(self, registry: Registry, ctx: ToolContext, *, approve: Approver | None = None,
                 on_start: StartHook | None = None, on_finish: FinishHook | None = None,
                 max_workers: int = MAX_WORKERS):
        self.registry = registry
        self.ctx = ctx
        self.approve = approve
        self.on_start = on_start
        self.on_finish = on_finish
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tool")
        self._validators: dict[str, Any] = {}

    def turn(self) -> Turn:
        return Turn(self)

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Run one turn's calls and return their results in call order."""
        turn = self.turn()
        for call in calls:
            turn.submit(call)
        return turn.results()

    def cancel(self) -> None:
        """Interrupt: running shell commands are killed, calls not yet started are skipped."""
        self.ctx.cancel.set()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- one call ------------------------------------------------------------------------------------

    def invoke(self, index: int, call: ToolCall) -> ToolResult:
        start = time.monotonic()
        if self.on_start:
            self.on_start(index, call)
        result = self._invoke(call)
        result.duration_s = time.monotonic() - start - result.approval_s
        if self.on_finish:
            self.on_finish(index, call, result)
        return result

    def _invoke(self, call: ToolCall) -> ToolResult:
        tool = self.registry.get(call.name)
        if tool is None:
            return ToolResult.error(f"unknown tool {call.name!r}; available tools: "
                                    + ", ".join(self.registry.names()))
        if self.ctx.cancel.is_set():
            return ToolResult.error("interrupted by the user before this call ran", interrupted=True)
        try:
            args = self.parse_arguments(tool, call.arguments)
        except ToolError as e:
            return ToolResult.error(str(e))
        waited = 0.0
        if self.approve is not None:
            asked = time.monotonic()
            refusal = self.approve(call, tool, args)
            waited = time.monotonic() - asked
            if refusal is not None:
                result = ToolResult.error(refusal, denied=True)
                result.approval_s = waited
                return result
        result = self._run(tool, call, args)
        result.approval_s = waited
        return result

    def _run(self, tool: Tool, call: ToolCall, args: dict[str, Any]) -> ToolResult:
        try:
            return tool.handler(self.ctx, **args)
        except ToolError as e:
            return ToolResult.error(str(e))
        except Exception as e:  # noqa: BLE001 - a tool bug must not kill the session
            log.error("tool %s raised:\n%s", call.name, traceback.format_exc())
            return ToolResult.error(f"{call.name} failed unexpectedly: {type(e).__name__}: {e}")

    def parse_arguments(self, tool: Tool, raw: str | dict[str, Any]) -> dict[str, Any]:
        """JSON text → dict, lightly coerced ("5" → 5, null optional → absent), schema-checked."""
        args: Any = raw
        if isinstance(raw, str):
            text = raw.strip() or "{}"
            try:
                args = json.loads(text)
            except json.JSONDecodeError as e:
                raise ToolError(f"arguments for {tool.name} are not valid JSON ({e.msg} at char {e.pos}); "
                                "send one JSON object with the parameters") from None
            if isinstance(args, str):  # double-encoded by some servers
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
        if not isinstance(args, dict):
            raise ToolError(f"arguments for {tool.name} must be a JSON object, got {type(args).__name__}")
        args = coerce(tool.parameters, args)
        errors = sorted(self._validator(tool).iter_errors(args), key=lambda e: list(e.path))
        if errors:
            problems = "; ".join(_describe(e) for e in errors[:5])
            raise ToolError(f"invalid arguments for {tool.name}: {problems}")
        return args

    def _validator(self, tool: Tool):
        v = self._validators.get(tool.name)
        if v is None:
            import jsonschema  # lazily: ~100 ms, not needed for --help

            v = self._validators[tool.name] = jsonschema.Draft202012Validator(tool.parameters)
        return v


class Turn:
    """The calls of one assistant message, submitted in order (possibly while still streaming)."""

    def __init__(self, executor: Executor):
        self.ex = executor
        self.futures: list[Future[ToolResult]] = []
        self._last_writer: Future[ToolResult] | None = None

    def submit(self, call: ToolCall) -> Future[ToolResult]:
        tool = self.ex.registry.get(call.name)
        exclusive = tool is not None and not tool.parallel_safe
        deps = list(self.futures) if exclusive else ([self._last_writer] if self._last_writer else [])
        index = len(self.futures)
        fut = self.ex._pool.submit(self._run, index, call, deps)
        self.futures.append(fut)
        if exclusive:
            self._last_writer = fut
        return fut

    def _run(self, index: int, call: ToolCall, deps: list[Future[ToolResult]]) -> ToolResult:
        if deps:
            wait_futures(deps)
        return self.ex.invoke(index, call)

    def results(self) -> list[ToolResult]:
        out = []
        for fut in self.futures:
            try:
                out.append(fut.result())
            except Exception as e:  # noqa: BLE001 - hooks raising; keep the turn consistent
                out.append(ToolResult.error(f"internal error: {type(e).__name__}: {e}"))
        return out


def coerce(schema: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Forgive the common slips of models: numbers and booleans as strings, null for optional params,
    arrays sent as JSON text."""
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    out = {}
    for key, value in args.items():
        spec = props.get(key)
        if spec is None:
            out[key] = value
            continue
        if value is None and key not in required:
            continue
        out[key] = _coerce_value(spec, value)
    return out


def _coerce_value(spec: dict[str, Any], value: Any) -> Any:
    kind = spec.get("type")
    if isinstance(value, str):
        s = value.strip()
        if kind == "integer" and re.fullmatch(r"[-+]?\d+", s):
            return int(s)
        if kind == "number" and re.fullmatch(r"[-+]?\d+(\.\d*)?([eE][-+]?\d+)?", s):
            return float(s)
        if kind == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if kind in ("array", "object") and s[:1] in "[{":
            try:
                value = json.loads(s)
            except json.JSONDecodeError:
                return value
    if kind == "array" and isinstance(value, list) and "items" in spec:
        return [_coerce_value(spec["items"], v) for v in value]
    if kind == "object" and isinstance(value, dict) and "properties" in spec:
        return {k: _coerce_value(spec["properties"].get(k, {}), v) for k, v in value.items()}
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _describe(err) -> str:
    where = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties":
        return err.message.replace("Additional properties are not allowed", "unknown parameter(s)")
    return f"{where}: {err.message}" if where else err.message
