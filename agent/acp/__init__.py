"""`composer-agent acp`: Composer inside editors that speak the Agent Client Protocol (Zed, JetBrains,
Neovim plugins). The SDK (the `acp` extra) is imported only here, when the subcommand runs.

stdout carries JSON-RPC and nothing else: the SDK writes to a duplicate of the original stdout, and
file descriptor 1 itself is pointed at stderr, so a stray print, a library's warning or a child
process that inherits stdout cannot corrupt the stream. Logs go to stderr.

Lines from the client pass a check before the SDK sees them: the SDK (0.12) answers nothing to a line
that is not JSON and stops serving at one that is JSON but not an object (a batch array), so those get
the JSON-RPC errors here (-32700 parse error, -32600 invalid request) and the agent keeps serving.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any


def main(root: Path, flags: dict[str, Any], mode: str | None = None) -> int:
    try:
        import acp  # noqa: F401
    except ImportError:  # said here, not through agent.cli's helper: cli imports this module
        print("composer-agent acp: the Agent Client Protocol server needs the `acp` extra "
              "(agent-client-protocol is not installed): pip install -e '.[acp]'", file=sys.stderr)
        return 2
    import asyncio

    rpc_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="composer-agent acp: %(message)s")
    os.chdir(root)  # relative paths a client sends resolve where it started us
    try:
        asyncio.run(_serve(rpc_out, flags, mode))
    except KeyboardInterrupt:
        return 130
    return 0


async def _serve(rpc_out: Any, flags: dict[str, Any], mode: str | None) -> None:
    import asyncio

    from acp import run_agent, stdio_streams

    from agent.acp.server import ComposerAcp

    # stdio_streams() opens sys.stdout: hand it the JSON-RPC duplicate for that moment only.
    sys.stdout = rpc_out
    try:
        raw, writer = await stdio_streams()
    finally:
        sys.stdout = sys.stderr
    checked = asyncio.StreamReader()
    pump = asyncio.create_task(_checked_lines(raw, checked, writer))
    agent = ComposerAcp(flags, mode)
    await agent.start()
    try:
        await run_agent(agent, writer, checked)  # returns when the client closes stdin
    finally:
        pump.cancel()
        await agent.shutdown()


async def _checked_lines(raw: Any, out: Any, writer: Any) -> None:
    """Forward well-formed JSON-RPC lines to the SDK; answer the others with an error (id null)."""
    import json

    while True:
        try:
            line = await raw.readline()
        except ValueError:  # longer than the reader's limit: drop what was buffered and go on
            code, message, line = -32700, "Parse error: line too long", b" "
        else:
            code = 0
        if not line:
            out.feed_eof()
            return
        if not line.strip():
            continue
        if not code:
            try:
                msg = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                code, message = -32700, "Parse error"
            else:
                if not isinstance(msg, dict) or not ("method" in msg or "id" in msg):
                    code, message = -32600, "Invalid Request: a JSON-RPC message is one object"
        if code:
            error = {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}
            writer.write((json.dumps(error) + "\n").encode())
            continue
        out.feed_data(line if line.endswith(b"\n") else line + b"\n")
