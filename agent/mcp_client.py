"""Tools from MCP servers: configured in `[mcp_servers.NAME]` tables, listed beside Composer's own.

Approach. The official SDK (`mcp`) is async and its transports are anyio context managers that must be
entered and left by the same task, while the agent's executor runs tools on threads. So one asyncio
loop in a daemon thread owns every connection: each server lives in one task that connects, lists its
tools, then sleeps inside an anyio cancel scope until it is told to stop, and leaving that scope runs
the SDK's own shutdown (close stdin, wait, then kill the server's process group). A tool call from a
worker thread is handed to that loop and waited on, watching the session's interrupt flag.

Servers start together when a runtime is built; one that fails or does not answer within its startup
timeout is reported once as a warning and its tools are absent, the agent still runs. Connections are
kept for the whole process (a new TUI session reuses them) and closed at exit.

Each tool becomes `SERVER__tool` (sanitised to the OpenAI function-name charset, at most 64 characters)
with the server's input schema. It is `parallel_safe` only when the server marks it read-only
(`readOnlyHint`), and counts as mutating otherwise, so approvals treat it like shell. Results become
observations: text as is, structured content as JSON, images, audio and binary resources as a
one-line summary; `isError`, exceptions and timeouts become error observations.

Limits: tools only (no resources, prompts or sampling); the tool list is read once at start
(`tools/list_changed` is not followed); no OAuth (HTTP servers take static `headers`).

`mcp` is imported here only inside functions: the SDK takes a second or more to import, and the agent
imports this module only when servers are configured.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import json
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import ConfigError
from agent.tools.base import Tool, ToolResult
from agent.tools.context import ToolContext

NAME_OK = re.compile(r"^[A-Za-z0-9_-]+$")
FUNCTION_NAME_BAD = re.compile(r"[^A-Za-z0-9_-]")
MAX_NAME = 64  # OpenAI's limit on function names
MAX_OUTPUT_CHARS = 40_000
STDIO_KEYS = {"command", "args", "env", "cwd"}
HTTP_KEYS = {"url", "headers"}
COMMON_KEYS = {"enabled", "startup_timeout_s", "tool_timeout_s"}
CLOSE_TIMEOUT_S = 10.0  # the SDK's stdio shutdown waits at most ~6 s (stdin close, SIGTERM, SIGKILL)


@dataclass
class ServerConfig:
    """One `[mcp_servers.NAME]` table: a stdio server (`command`) or a streamable HTTP one (`url`)."""

    name: str
    command: str | None = None
    """Executable of a stdio server (looked up on PATH)."""
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for a stdio server, over the SDK's minimal default (PATH, HOME, ...);
    `${VAR}` in values is expanded from Composer's own environment at start."""
    cwd: str | None = None
    """Working directory of a stdio server, relative to the workspace; default the workspace."""
    url: str | None = None
    """Endpoint of a streamable HTTP server, e.g. http://127.0.0.1:8931/mcp."""
    headers: dict[str, str] = field(default_factory=dict)
    """HTTP headers sent to the server (`${VAR}` expanded), e.g. Authorization."""
    enabled: bool = True
    startup_timeout_s: float = 30.0
    """Longest wait for the server to start and list its tools."""
    tool_timeout_s: float = 120.0
    """Longest wait for one tool call."""

    @property
    def kind(self) -> str:
        return "stdio" if self.command else "http"


def parse_servers(raw: Any) -> list[ServerConfig]:
    """Validate the `mcp_servers` table; raise ConfigError naming the server and key at fault."""
    if not isinstance(raw, dict):
        raise ConfigError("mcp_servers must be a table of servers ([mcp_servers.NAME])")
    out: list[ServerConfig] = []
    for name, spec in raw.items():
        where = f"mcp_servers.{name}"
        if not NAME_OK.match(name):
            raise ConfigError(f"{where}: server names may use only letters, digits, '_' and '-'")
        if not isinstance(spec, dict):
            raise ConfigError(f"{where} must be a table with `command` (stdio) or `url` (streamable HTTP)")
        if spec == {"enabled": False}:  # how a repository turns off a server of the user's config
            continue
        if ("command" in spec) == ("url" in spec):
            raise ConfigError(
                f"{where} needs exactly one of `command` (a stdio server) or `url` (streamable HTTP)"
            )
        allowed = COMMON_KEYS | (STDIO_KEYS if "command" in spec else HTTP_KEYS)
        unknown = set(spec) - allowed
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(sorted(unknown))} "
                f"(a {'stdio' if 'command' in spec else 'streamable HTTP'} server takes "
                f"{', '.join(sorted(allowed))})"
            )
        _check(where, spec, "command", str, "a string")
        _check(where, spec, "cwd", str, "a string")
        _check(where, spec, "url", str, "a string")
        _check(where, spec, "enabled", bool, "true or false")
        if not (
            isinstance(spec.get("args", []), list) and all(isinstance(a, str) for a in spec.get("args", []))
        ):
            raise ConfigError(f"{where}.args must be a list of strings")
        for key in ("env", "headers"):
            table = spec.get(key, {})
            if not (isinstance(table, dict) and all(isinstance(v, str) for v in table.values())):
                raise ConfigError(f"{where}.{key} must be a table of strings")
        for key in ("startup_timeout_s", "tool_timeout_s"):
            value = spec.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{where}.{key} must be a positive number of seconds, got {value!r}")
        if "command" in spec and not spec["command"].strip():
            raise ConfigError(f"{where}.command is empty")
        if "url" in spec and not spec["url"].startswith(("http://", "https://")):
            raise ConfigError(f"{where}.url must start with http:// or https://, got {spec['url']!r}")
        out.append(ServerConfig(name=name, **spec))
    return out


def _check(where: str, spec: dict[str, Any], key: str, typ: type, what: str) -> None:
    if key in spec and not isinstance(spec[key], typ):
        raise ConfigError(f"{where}.{key} must be {what}, got {spec[key]!r}")


# -- names, schemas, results -------------------------------------------------------------------------


def tool_name(server: str, tool: str, taken: set[str]) -> str:
    """`server__tool` in the OpenAI function-name charset, at most 64 characters, unique in `taken`."""
    name = FUNCTION_NAME_BAD.sub("_", f"{server}__{tool}")
    if len(name) > MAX_NAME or name in taken:
        digest = hashlib.sha256(f"{server}\0{tool}".encode()).hexdigest()[:8]
        name = f"{name[: MAX_NAME - 9]}_{digest}"
    return name


def input_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The server's JSON schema as an OpenAI `parameters` object (always an object with properties)."""
    out = {k: v for k, v in schema.items() if k != "$schema"}
    out["type"] = "object"
    out.setdefault("properties", {})
    return out


def observation(result: Any, server: str, tool: str) -> ToolResult:
    """A CallToolResult as what the model sees: text first, structured content as JSON when no text
    carries it, everything binary as a short summary."""
    parts: list[str] = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            size = len(block.data) * 3 // 4  # base64
            parts.append(f"[{kind}: {block.mime_type}, {size} bytes, not shown]")
        elif kind == "resource_link":
            parts.append(
                f"[resource link: {block.uri}" + (f" ({block.mime_type})" if block.mime_type else "") + "]"
            )
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            if text is not None:
                parts.append(f"[resource {res.uri}]\n{text}")
            else:
                parts.append(
                    f"[resource {res.uri}: {res.mime_type or 'binary'}, "
                    f"{len(getattr(res, 'blob', '')) * 3 // 4} bytes, not shown]"
                )
        else:
            parts.append(f"[{kind or type(block).__name__} content, not shown]")
    structured = result.structured_content
    if structured is not None and not any(_same_json(p, structured) for p in parts):
        parts.append(json.dumps(structured, ensure_ascii=False, indent=1))
    text = "\n".join(parts) or "(no output)"
    if len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS] + f"\n… [{len(text) - MAX_OUTPUT_CHARS} more characters cut]"
    data = {"server": server, "tool": tool}
    if result.is_error:
        return ToolResult(content=f"Error: {text}", ok=False, data=data)
    return ToolResult(content=text, data=data)


def _same_json(text: str, value: Any) -> bool:
    if isinstance(value, dict) and set(value) == {"result"} and text == str(value["result"]):
        return True  # the SDK wraps a plain return value as {"result": ...} beside its text
    try:
        return json.loads(text) == value
    except ValueError:
        return False


RETRY_S = 0.25  # between connection attempts to an HTTP server that is still starting


def _refused(exc: BaseException) -> bool:
    """Whether a failure is a refused connection (ConnectionRefusedError, httpx.ConnectError), however
    deep in task groups' ExceptionGroups or causes."""
    seen: list[BaseException | None] = [exc]
    visited: set[int] = set()
    while seen:
        e = seen.pop()
        if e is None or id(e) in visited:
            continue
        visited.add(id(e))
        if isinstance(e, ConnectionRefusedError) or type(e).__name__ == "ConnectError":
            return True
        if isinstance(e, BaseExceptionGroup):
            seen.extend(e.exceptions)
        seen.append(e.__cause__)
    return False


def _describe(exc: BaseException) -> str:
    """The innermost useful message of an exception (task groups wrap them in ExceptionGroups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- the connections ---------------------------------------------------------------------------------


class Hub:
    """The connections to a set of servers, owned by one event loop in a daemon thread."""

    def __init__(self, servers: list[ServerConfig], root: Path, log_dir: Path):
        import asyncio

        self.servers = [s for s in servers if s.enabled]
        self.root, self.log_dir = root, log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        _log_sdk_to(log_dir / "client.log")
        self.tools: list[Tool] = []
        self.warnings: list[str] = []
        self._clients: dict[str, Any] = {}
        self._scopes: dict[str, Any] = {}  # server name -> the anyio cancel scope its task sleeps in
        self._tasks: list[Any] = []
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp", daemon=True)
        self._thread.start()

    def start(self) -> None:
        """Connect to every server at once; collect their tools, and a warning per failure."""
        self._submit(self._start_all()).result()

    def close(self) -> None:
        """Stop every server (stdio processes exit or are killed) and the loop."""
        if self._closed:
            return
        self._closed = True
        try:
            self._submit(self._stop_all()).result(timeout=CLOSE_TIMEOUT_S + 2)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2)

    def _submit(self, coro):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start_all(self) -> None:
        import asyncio

        results = await asyncio.gather(*(self._start(s) for s in self.servers))
        taken: set[str] = set()
        for server, listed in zip(self.servers, results, strict=True):
            for mcp_tool in listed or []:
                tool = self._tool(server, mcp_tool, taken)
                if tool is not None:
                    taken.add(tool.name)
                    self.tools.append(tool)

    async def _start(self, server: ServerConfig) -> list[Any] | None:
        import asyncio

        ready: asyncio.Future = self._loop.create_future()
        # A server that fails after its startup timeout sets an exception nobody awaits any more.
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._tasks.append(asyncio.ensure_future(self._serve(server, ready)))
        try:
            return await asyncio.wait_for(asyncio.shield(ready), server.startup_timeout_s)
        except TimeoutError:
            self._stop(server.name)
            why = f"did not start within {server.startup_timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - a broken server costs its tools, not the session
            why = f"failed to start: {_describe(e)}"
        self.warnings.append(
            f"MCP server {server.name} {why}; its tools are not available." + self._log_hint(server)
        )
        return None

    async def _serve(self, server: ServerConfig, ready) -> None:
        """Connect, list the tools, then hold the connection until stopped; leaving the `async with`
        blocks is what shuts the server down. An HTTP server that refuses the connection (still starting)
        is tried again every RETRY_S until its startup timeout, as a stdio server is given that long."""
        import anyio
        from mcp import Client

        try:
            with anyio.CancelScope() as scope:
                self._scopes[server.name] = scope
                while True:
                    try:
                        async with self._transport(server) as transport:
                            async with Client(transport, read_timeout_seconds=server.startup_timeout_s) as client:
                                tools, cursor = [], None
                                while True:
                                    page = await client.list_tools(cursor=cursor)
                                    tools.extend(page.tools)
                                    cursor = page.next_cursor
                                    if not cursor:
                                        break
                                self._clients[server.name] = client
                                ready.set_result(tools)
                                await anyio.sleep_forever()
                    except Exception as e:  # noqa: BLE001 - refused: retried below; anything else: raised
                        if not (server.url and not ready.done() and _refused(e)):
                            raise
                    await anyio.sleep(RETRY_S)  # the startup timeout (_start) stops this loop
        except BaseException as e:  # noqa: BLE001 - reported to the starter, or seen by the next call
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(_describe(e)))
            if not isinstance(e, Exception):
                raise
        finally:
            self._clients.pop(server.name, None)
        if not ready.done():
            ready.set_exception(RuntimeError("stopped before it started"))

    def _transport(self, server: ServerConfig):
        """An async context manager yielding the SDK transport (and owning what it needs)."""
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def stdio():
            from mcp import StdioServerParameters
            from mcp.client.stdio import stdio_client

            params = StdioServerParameters(
                command=server.command,
                args=list(server.args),
                cwd=self.root / (server.cwd or "."),
                env={k: os.path.expandvars(v) for k, v in server.env.items()} or None,
            )
            # The server's stderr goes to a log file: on our stderr it would scribble over the TUI.
            with open(self._log_path(server), "w") as errlog:
                yield stdio_client(params, errlog=errlog)

        @asynccontextmanager
        async def http():
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            headers = {k: os.path.expandvars(v) for k, v in server.headers.items()}
            async with create_mcp_http_client(headers=headers or None) as http_client:
                yield streamable_http_client(server.url, http_client=http_client)

        return stdio() if server.kind == "stdio" else http()

    def _log_path(self, server: ServerConfig) -> Path:
        return self.log_dir / f"{server.name}.log"

    def _log_hint(self, server: ServerConfig) -> str:
        """The end of a stdio server's stderr, which usually says why it failed."""
        if server.kind != "stdio":
            return ""
        path = self._log_path(server)
        try:
            tail = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()][-3:]
        except OSError:
            return ""
        if not tail:
            return ""
        shown = "".join(f"\n  {ln[:200]}" for ln in tail)
        return f" Its stderr ({path}) ends:{shown}"

    def _stop(self, name: str) -> None:
        scope = self._scopes.get(name)
        if scope is not None:
            scope.cancel()

    async def _stop_all(self) -> None:
        import asyncio

        for name in list(self._scopes):
            self._stop(name)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=CLOSE_TIMEOUT_S)

    # -- tools ---------------------------------------------------------------------------------------

    def _tool(self, server: ServerConfig, mcp_tool: Any, taken: set[str]) -> Tool | None:
        import jsonschema

        schema = input_schema(mcp_tool.input_schema or {})
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except Exception as e:  # noqa: BLE001 - SchemaError, or a schema the validator cannot read at all
            self.warnings.append(
                f"MCP server {server.name}: tool {mcp_tool.name} has an invalid input "
                f"schema ({getattr(e, 'message', e)}); it is left out."
            )
            return None
        read_only = bool(mcp_tool.annotations and mcp_tool.annotations.read_only_hint)
        original = mcp_tool.name

        def handler(ctx: ToolContext, /, **args: Any) -> ToolResult:
            return self.call(server, original, args, ctx.cancel)

        description = (
            mcp_tool.description or mcp_tool.title or f"The {original} tool of MCP server {server.name}."
        )
        return Tool(
            name=tool_name(server.name, original, taken),
            description=description,
            parameters=schema,
            handler=handler,
            parallel_safe=read_only,
            mutates=not read_only,
        )

    def call(
        self, server: ServerConfig, tool: str, args: dict[str, Any], cancel: threading.Event
    ) -> ToolResult:
        """Run one tool call on the loop and wait for it, giving up on interrupt or timeout."""
        client = self._clients.get(server.name)
        if client is None:
            return ToolResult.error(
                f"MCP server {server.name} is not running (it exited or was stopped)."
                + self._log_hint(server),
                server=server.name,
                tool=tool,
            )
        holder: list[Any] = []

        async def run():
            import anyio

            with anyio.CancelScope() as scope:
                holder.append(scope)
                return await client.call_tool(tool, args, read_timeout_seconds=server.tool_timeout_s)
            return None  # cancelled by an interrupt

        fut = self._submit(run())
        give_up = server.tool_timeout_s + 5  # the SDK times out first; this is the backstop
        waited = 0.0
        while True:
            try:
                result = fut.result(timeout=0.05)
                break
            except concurrent.futures.TimeoutError:
                waited += 0.05
                if cancel.is_set() or waited > give_up:
                    if holder:
                        self._loop.call_soon_threadsafe(holder[0].cancel)
                    else:
                        fut.cancel()  # not started yet: nothing was sent
                    if cancel.is_set():
                        return ToolResult.error(
                            "interrupted by the user", interrupted=True, server=server.name, tool=tool
                        )
                    return ToolResult.error(
                        f"{tool} on MCP server {server.name} timed out after {server.tool_timeout_s:g} s",
                        server=server.name,
                        tool=tool,
                    )
            except Exception as e:  # noqa: BLE001 - protocol errors, timeouts, a dead server
                message = _describe(e)
                if "timed out" in message:
                    message = f"timed out after {server.tool_timeout_s:g} s ({message})"
                elif "Connection closed" in message:
                    message = f"the server closed the connection; it may have exited ({message}).{self._log_hint(server)}"
                return ToolResult.error(
                    f"{tool} on MCP server {server.name}: {message}", server=server.name, tool=tool
                )
        if result is None:
            return ToolResult.error(
                "interrupted by the user", interrupted=True, server=server.name, tool=tool
            )
        return observation(result, server.name, tool)


def _log_sdk_to(path: Path) -> None:
    """The SDK's own log lines (a server writing junk to stdout, an odd SSE event) go to a file:
    on stderr they would land in headless output and across the TUI."""
    import logging

    logger = logging.getLogger("mcp")
    if not logger.handlers:
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


# -- one set of connections per process --------------------------------------------------------------

_hubs: dict[str, Hub] = {}
_hubs_lock = threading.Lock()
_atexit_registered = False


def connect(raw_servers: dict[str, Any], root: Path, log_dir: Path) -> tuple[list[Tool], list[str]]:
    """The tools of the configured servers and the warnings about those that did not start.

    Connections are shared by every runtime of the process built with the same servers and root
    (a TUI's /new reuses them) and closed at exit, or by `shutdown()`."""
    servers = parse_servers(raw_servers)
    key = json.dumps([str(root), [asdict(s) for s in servers]], sort_keys=True)
    global _atexit_registered
    with _hubs_lock:
        hub = _hubs.get(key)
        if hub is None:
            if not _atexit_registered:
                _atexit_registered = True
                atexit.register(shutdown)
            hub = _hubs[key] = Hub(servers, root, log_dir)
            hub.start()
            return list(hub.tools), list(hub.warnings)
    return list(hub.tools), []  # warned once, when they were first started


def shutdown() -> None:
    """Close every server connection of this process (stdio servers exit)."""
    with _hubs_lock:
        hubs = list(_hubs.values())
        _hubs.clear()
    for hub in hubs:
        hub.close()
