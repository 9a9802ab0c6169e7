"""Calling tools the way the loop does: through the registry and the executor, with JSON arguments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent.tools import Executor, ToolCall, ToolContext, ToolResult, default_registry


class Tools:
    """A workspace plus an executor; `call(name, **args)` runs one call and returns its result."""

    def __init__(self, root: Path, **ctx_kw: Any):
        self.root = root
        self.ctx = ToolContext.for_root(root, **ctx_kw)
        self.executor = Executor(default_registry(), self.ctx)

    def call(self, name: str, **args: Any) -> ToolResult:
        return self.executor.run([ToolCall("c1", name, json.dumps(args))])[0]

    def ok(self, name: str, **args: Any) -> str:
        r = self.call(name, **args)
        assert r.ok, r.content
        return r.content

    def err(self, name: str, **args: Any) -> str:
        r = self.call(name, **args)
        assert not r.ok, r.content
        assert r.content.startswith("Error: ")
        return r.content
