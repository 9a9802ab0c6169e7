"""A small real MCP server for tests/agent/test_mcp.py, built with the official SDK.

    python tests/agent/mcp_server.py stdio        # speaks MCP on stdin/stdout
    python tests/agent/mcp_server.py http [PORT]  # streamable HTTP on a free (or this) loopback port, printed first

Its tools cover what the client must handle: a read-only tool, a tool that writes a file (so a test
can see whether it really ran), a tool that fails, structured output, an image, a slow tool and a
name outside the OpenAI function-name charset.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import sys
import time

from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.types import ToolAnnotations

READ_ONLY = ToolAnnotations(readOnlyHint=True)
PNG_1PX = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)

# Plain log lines: the SDK's default rich tracebacks take a second to render on a busy machine,
# which a test with short timeouts would read as a hung server.
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
server = MCPServer("fixture", log_level="WARNING")


@server.tool(annotations=READ_ONLY)
def lookup(key: str) -> str:
    """Look up a value: "answer", the server's "pid" or "cwd", or "env:NAME" for an environment variable."""
    if key.startswith("env:"):
        return os.environ.get(key[4:], "(unset)")
    table = {"answer": "forty-two", "pid": str(os.getpid()), "cwd": os.getcwd()}
    return table.get(key, f"no value for {key}")


@server.tool()
def append_note(path: str, text: str) -> str:
    """Append a line of text to a file (a tool with a side effect)."""
    with open(path, "a") as f:
        f.write(text + "\n")
    return f"appended {len(text)} characters to {path}"


@server.tool(annotations=READ_ONLY)
def explode(reason: str) -> str:
    """Always fails with the given reason."""
    raise ValueError(f"exploded: {reason}")


@server.tool(annotations=READ_ONLY)
def stats(numbers: list[float]) -> dict[str, float]:
    """Count, sum and mean of some numbers (structured output)."""
    return {"count": len(numbers), "sum": sum(numbers), "mean": sum(numbers) / max(len(numbers), 1)}


@server.tool(annotations=READ_ONLY)
def picture() -> Image:
    """A one-pixel PNG."""
    return Image(data=PNG_1PX, format="png")


@server.tool(annotations=READ_ONLY)
def nap(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def die() -> str:
    """Exit the server process at once (a server crashing mid-session)."""
    os._exit(1)


@server.tool(annotations=READ_ONLY)
def header(name: str, ctx: Context) -> str:
    """The value of an HTTP request header (over streamable HTTP)."""
    return (ctx.headers or {}).get(name.lower(), "(no such header)")


@server.tool(name="odd.name with spaces", annotations=READ_ONLY)
def odd() -> str:
    """A tool whose name is outside the OpenAI function-name charset."""
    return "odd ok"


def serve_http(port: int = 0) -> None:
    import anyio
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)  # before the port is printed: a client may connect the moment it reads it
    print(sock.getsockname()[1], flush=True)  # the test reads the port from the first line
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    anyio.run(uvicorn.Server(config).serve, [sock])


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        serve_http(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    else:
        server.run("stdio")
