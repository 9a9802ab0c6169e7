"""semantic_search: meaning-based code search over the workspace's embedding index (see index/)."""

from __future__ import annotations

from typing import Annotated

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext


@tool(parallel_safe=True)
def semantic_search(
    ctx: ToolContext,
    query: str,
    k: Annotated[int, {"minimum": 1, "maximum": 50}] = 10,
    path: str | None = None,
) -> ToolResult:
    """Find code by meaning rather than exact text: describe what you are looking for in plain words
    ("where are HTTP retries handled", "function that parses the config file"). Returns ranked code
    chunks with path:lines and snippets. Use grep instead for exact identifiers or strings.

    Args:
        query: What you are looking for, in natural language or code terms.
        k: Number of results to return (default 10).
        path: Only return results under this folder, relative to the workspace root.
    """
    raise ToolError("semantic_search is not available yet in this build (no code index); "
                    "use grep and glob to find code")
