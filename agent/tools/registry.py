"""The tool registry: specs and handlers together, in a fixed order, fingerprinted by `spec_hash`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from agent.tools.base import Tool


class Registry:
    """An ordered set of tools. `specs()` is what the model is sent; `get()` finds a handler."""

    def __init__(self, tools: Iterable[Tool]):
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self._tools:
                raise ValueError(f"duplicate tool name {t.name!r}")
            self._tools[t.name] = t

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return list(self._tools)

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self._tools.values()]

    def spec_hash(self) -> str:
        return spec_hash(self.specs())

    def only(self, names: Iterable[str]) -> Registry:
        wanted = set(names)
        unknown = wanted - set(self._tools)
        if unknown:
            raise ValueError(f"unknown tools: {sorted(unknown)}")
        return Registry(t for t in self._tools.values() if t.name in wanted)

    def __iter__(self):
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)


def spec_hash(specs: list[dict[str, Any]]) -> str:
    """A stable fingerprint of a tool spec list (order matters: it is part of the prompt)."""
    blob = json.dumps(specs, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_registry() -> Registry:
    """All of Composer's tools, in the order the model sees them."""
    from agent.tools.edit_file import edit_file
    from agent.tools.glob import glob
    from agent.tools.grep import grep
    from agent.tools.lint import lint
    from agent.tools.list_dir import list_dir
    from agent.tools.read_file import read_file
    from agent.tools.semantic_search import semantic_search
    from agent.tools.shell import shell
    from agent.tools.todo import todo_write
    from agent.tools.write_file import write_file

    return Registry([read_file, write_file, edit_file, grep, glob, list_dir, shell, lint, todo_write,
                     semantic_search])
