"""The languages the chunker parses: grammar, which nodes are definitions, and how a definition is named.

Grammars come from the individual `tree-sitter-<lang>` wheels (they work offline; the language-pack
downloads grammars at run time and does not). A language whose wheel is missing degrades to line
windows rather than failing the whole index.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache

# file extension -> language name
EXTENSIONS = {
    "py": "python", "pyi": "python",
    "js": "javascript", "mjs": "javascript", "cjs": "javascript", "jsx": "javascript",
    "ts": "typescript", "mts": "typescript", "cts": "typescript", "tsx": "tsx",
    "go": "go", "rs": "rust", "java": "java",
    "c": "c", "h": "c",
    "cc": "cpp", "cpp": "cpp", "cxx": "cpp", "c++": "cpp", "hh": "cpp", "hpp": "cpp", "hxx": "cpp",
    "h++": "cpp", "ipp": "cpp", "tpp": "cpp",
}

# language -> (module, function returning the grammar)
GRAMMARS = {
    "python": ("tree_sitter_python", "language"),
    "javascript": ("tree_sitter_javascript", "language"),
    "typescript": ("tree_sitter_typescript", "language_typescript"),
    "tsx": ("tree_sitter_typescript", "language_tsx"),
    "go": ("tree_sitter_go", "language"),
    "rust": ("tree_sitter_rust", "language"),
    "java": ("tree_sitter_java", "language"),
    "c": ("tree_sitter_c", "language"),
    "cpp": ("tree_sitter_cpp", "language"),
}

_JS_DEFS = {"function_declaration", "generator_function_declaration", "class_declaration",
            "method_definition"}
_TS_DEFS = _JS_DEFS | {"abstract_class_declaration", "interface_declaration", "type_alias_declaration",
                       "enum_declaration", "internal_module", "module", "function_signature",
                       "abstract_method_signature"}
_C_DEFS = {"function_definition", "struct_specifier", "union_specifier", "enum_specifier",
           "type_definition"}

# Node types that are definitions (functions, methods, classes and their kin).
DEFINITIONS: dict[str, frozenset[str]] = {
    "python": frozenset({"function_definition", "class_definition"}),
    "javascript": frozenset(_JS_DEFS),
    "typescript": frozenset(_TS_DEFS),
    "tsx": frozenset(_TS_DEFS),
    "go": frozenset({"function_declaration", "method_declaration", "type_declaration"}),
    "rust": frozenset({"function_item", "impl_item", "struct_item", "enum_item", "union_item",
                       "trait_item", "mod_item", "macro_definition"}),
    "java": frozenset({"class_declaration", "interface_declaration", "enum_declaration",
                       "record_declaration", "annotation_type_declaration", "method_declaration",
                       "constructor_declaration"}),
    "c": frozenset(_C_DEFS),
    "cpp": frozenset(_C_DEFS | {"class_specifier", "namespace_definition"}),
}

# Nodes that wrap one definition and belong with it (decorators, `export`, `template <...>`).
WRAPPERS = frozenset({"decorated_definition", "export_statement", "template_declaration"})
# Definitions that hold others (classes, impls, modules): the chunker gives each member its own chunk
# rather than one vector for the whole, so a member's vector describes that member.
CONTAINERS = frozenset({"class_definition", "class_declaration", "abstract_class_declaration", "class",
                        "class_specifier", "impl_item", "trait_item", "mod_item", "interface_declaration",
                        "internal_module", "module", "namespace_definition", "enum_declaration",
                        "record_declaration", "struct_specifier"})
# Siblings that may stand between a doc comment and its definition (Rust `#[attr]`, C++ `[[attr]]`).
ATTRIBUTES = frozenset({"attribute_item", "attribute_declaration"})
# `const f = () => ...` is how much JS/TS defines functions.
_JS_VALUE_DEFS = frozenset({"arrow_function", "function_expression", "function", "class",
                            "generator_function"})
_BODY_FIELDS = {"struct_specifier", "union_specifier", "enum_specifier", "class_specifier"}


@dataclass(frozen=True)
class Definition:
    name: str
    kind: str  # the node type, for the record


def language_for(path: str) -> str | None:
    name = path.rsplit("/", 1)[-1].lower()
    return EXTENSIONS.get(name.rsplit(".", 1)[-1]) if "." in name else None


def parser_for(lang: str):
    """A new tree-sitter Parser (parsers are not thread-safe; they are cheap), or None when the grammar
    wheel is not installed."""
    grammar = _grammar(lang)
    if grammar is None:
        return None
    import tree_sitter

    return tree_sitter.Parser(grammar)


@cache
def _grammar(lang: str):
    module, fn = GRAMMARS[lang]
    try:
        import tree_sitter

        return tree_sitter.Language(getattr(importlib.import_module(module), fn)())
    except (ImportError, AttributeError, ValueError):
        return None


def definition(node, lang: str) -> Definition | None:
    """The definition `node` is (or wraps), with its name; None for anything else."""
    t = node.type
    if t in WRAPPERS:
        for child in node.named_children:
            d = definition(child, lang)
            if d is not None:
                return d
        return None
    if t in ("lexical_declaration", "variable_declaration") and lang in ("javascript", "typescript", "tsx"):
        decls = [c for c in node.named_children if c.type == "variable_declarator"]
        if len(decls) == 1:
            value = decls[0].child_by_field_name("value")
            if value is not None and value.type in _JS_VALUE_DEFS:
                return Definition(_text(decls[0].child_by_field_name("name")), "function")
        return None
    if t == "expression_statement" and lang in ("javascript", "typescript", "tsx"):
        # `res.send = function send(body) {...}`: how much older JS (express, lodash) defines methods.
        a = node.named_children[0] if node.named_children else None
        if a is not None and a.type == "assignment_expression":
            right = a.child_by_field_name("right")
            if right is not None and right.type in _JS_VALUE_DEFS:
                return Definition(_text(a.child_by_field_name("left")), "function")
        return None
    if t not in DEFINITIONS[lang]:
        return None
    if t in _BODY_FIELDS and node.child_by_field_name("body") is None:
        return None  # `struct S x;` uses a type, it does not define one
    return Definition(_name(node, lang) or "<anonymous>", t)


def _name(node, lang: str) -> str:
    t = node.type
    if t == "function_definition" and lang in ("c", "cpp"):
        d = node.child_by_field_name("declarator")
        while d is not None and d.child_by_field_name("declarator") is not None:
            d = d.child_by_field_name("declarator")
        return _text(d)
    if t == "type_definition":
        return _text(node.child_by_field_name("declarator"))
    if t == "method_declaration" and lang == "go":
        recv = node.child_by_field_name("receiver")
        rtype = ""
        if recv is not None:
            for p in recv.named_children:
                rtype = _text(p.child_by_field_name("type")).lstrip("*").split("[")[0]
                break
        name = _text(node.child_by_field_name("name"))
        return f"{rtype}.{name}" if rtype else name
    if t == "type_declaration":
        for spec in node.named_children:
            if spec.child_by_field_name("name") is not None:
                return _text(spec.child_by_field_name("name"))
        return ""
    if t == "impl_item":  # methods are named after the type, whichever trait they implement
        return _text(node.child_by_field_name("type")).split("<")[0]
    return _text(node.child_by_field_name("name"))


def _text(node) -> str:
    if node is None or node.text is None:
        return ""
    return node.text.decode("utf-8", errors="replace")
