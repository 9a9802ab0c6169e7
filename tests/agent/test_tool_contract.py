"""The public tool contract: names, parameters, schemas derived from typed functions, the spec hash."""

from __future__ import annotations

from typing import Annotated, Literal, TypedDict

import jsonschema
import pytest

from agent.tools import ToolResult, default_registry, spec_hash, tool
from agent.tools.base import _parse_docstring
from agent.tools.registry import Registry

CONTRACT = {
    "read_file": (["path"], ["limit", "offset"]),
    "write_file": (["content", "path"], []),
    "edit_file": (["new_string", "old_string", "path"], ["replace_all"]),
    "grep": (["pattern"], ["case_insensitive", "context", "glob", "head_limit", "output_mode", "path"]),
    "glob": (["pattern"], ["path"]),
    "list_dir": ([], ["path"]),
    "shell": (["command"], ["timeout_s"]),
    "lint": ([], ["paths"]),
    "todo_write": (["todos"], []),
    "semantic_search": (["query"], ["k", "path"]),
}


def test_names_and_parameters_are_the_public_contract():
    reg = default_registry()
    assert reg.names() == list(CONTRACT)
    for t in reg:
        params = t.parameters
        required, optional = CONTRACT[t.name]
        assert sorted(params.get("required", [])) == required, t.name
        assert sorted(set(params["properties"]) - set(required)) == optional, t.name
        assert params["additionalProperties"] is False
        jsonschema.Draft202012Validator.check_schema(params)
        assert t.description and "Args:" not in t.description
        for name, prop in params["properties"].items():
            assert prop.get("description"), f"{t.name}.{name} has no description"


def test_parallel_safety_flags():
    reg = default_registry()
    safe = {t.name for t in reg if t.parallel_safe}
    assert safe == {"read_file", "grep", "glob", "list_dir", "lint", "semantic_search", "shell"}
    assert {t.name for t in reg if t.mutates} == {"write_file", "edit_file", "shell"}


def test_schema_details():
    specs = {s["function"]["name"]: s["function"]["parameters"] for s in default_registry().specs()}
    assert specs["grep"]["properties"]["output_mode"]["enum"] == ["files_with_matches", "content", "count"]
    assert specs["shell"]["properties"]["timeout_s"] == {
        "type": "integer", "minimum": 1, "maximum": 600,
        "description": specs["shell"]["properties"]["timeout_s"]["description"]}
    todo_item = specs["todo_write"]["properties"]["todos"]["items"]
    assert todo_item["properties"]["status"]["enum"] == ["pending", "in_progress", "completed"]
    assert todo_item["required"] == ["content", "status"]
    assert specs["lint"]["properties"]["paths"]["type"] == "array"


def test_spec_hash_is_stable_and_sensitive():
    reg = default_registry()
    assert reg.spec_hash() == default_registry().spec_hash() == spec_hash(reg.specs())
    specs = reg.specs()
    specs[0]["function"]["description"] += " "
    assert spec_hash(specs) != reg.spec_hash()
    assert spec_hash(list(reversed(reg.specs()))) != reg.spec_hash()


class Item(TypedDict):
    name: str
    size: int


def test_schema_derivation_from_a_typed_function():
    @tool(parallel_safe=True)
    def sample(ctx, a: str, items: list[Item], mode: Literal["x", "y"] = "x",
               n: Annotated[int, {"minimum": 2}] = 3, flag: bool | None = None) -> ToolResult:
        """Do a thing.

        Second paragraph
        continues here.

        Args:
            a: The a.
            items: Items to use,
                over two lines.
            mode: Which mode.
            n: How many.
            flag: A flag.
        """
        return ToolResult("")

    assert sample.description == "Do a thing.\n\nSecond paragraph continues here."
    p = sample.parameters
    assert p["required"] == ["a", "items"]
    assert p["properties"]["items"]["description"] == "Items to use, over two lines."
    assert p["properties"]["items"]["items"]["properties"] == {"name": {"type": "string"}, "size": {"type": "integer"}}
    assert p["properties"]["mode"]["enum"] == ["x", "y"]
    assert p["properties"]["n"]["minimum"] == 2
    assert p["properties"]["flag"]["type"] == "boolean"


def test_undocumented_parameter_is_refused():
    with pytest.raises(TypeError, match="not documented"):
        @tool(parallel_safe=True)
        def bad(ctx, a: str) -> ToolResult:
            """No args section."""
            return ToolResult("")


def test_docstring_parser_stops_at_next_section():
    desc, params = _parse_docstring("Hi.\n\nArgs:\n    x: the x.\n\nReturns:\n    y: not a param\n")
    assert desc == "Hi." and params == {"x": "the x."}


def test_registry_rejects_duplicates_and_subsets():
    reg = default_registry()
    with pytest.raises(ValueError):
        Registry([reg.get("grep"), reg.get("grep")])
    sub = reg.only(["grep", "read_file"])
    assert sub.names() == ["read_file", "grep"]
    with pytest.raises(ValueError):
        reg.only(["nope"])
