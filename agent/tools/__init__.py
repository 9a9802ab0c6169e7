"""The agent's tools: one per file, a registry that returns specs and handlers together, an executor.

Public contract (models are trained on it): tool names, parameter names, and their meaning.
"""

from agent.tools.base import Tool, ToolError, ToolResult, tool
from agent.tools.context import ToolContext, Workspace
from agent.tools.executor import Executor, ToolCall
from agent.tools.registry import Registry, default_registry, spec_hash

__all__ = ["Executor", "Registry", "Tool", "ToolCall", "ToolContext", "ToolError", "ToolResult",
           "Workspace", "default_registry", "spec_hash", "tool"]
