"""The import rules of ARCHITECTURE.md, enforced.

Static: module-level imports (anything not inside a function) of each package are checked against
what that package may depend on. Dynamic: importing every agent module in a fresh interpreter must not
load torch, serve or train.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["agent", "serve", "index", "kernels", "train"]

# package -> top-level modules it must not import at module level
FORBIDDEN = {
    "agent": {"torch", "triton", "serve", "train", "index", "kernels", "transformers", "textual",
              "sentence_transformers", "faiss", "numpy", "prompt_toolkit", "mcp", "acp", "pydantic"},
    "index": {"agent", "serve", "train", "kernels"},
    "kernels": {"agent", "serve", "train", "index"},
    "serve": {"train", "index"},
    "train": {"index"},
}
# Sub-packages that exist to hold a heavy front-end may import it at module level (they are themselves
# only imported lazily, and the dynamic test below checks that).
ALLOWED = {
    "agent/tui": {"textual"},
    "agent/plain": {"prompt_toolkit"},
    "agent/acp": {"acp"},  # the ACP server; agent/acp/__init__.py itself imports the SDK only in main()
}
# serve may use agent's pure-data protocol modules and nothing else of agent.
SERVE_MAY_IMPORT_FROM_AGENT = {"agent", "agent.protocol", "agent.toolcall_text"}


def _module_level_imports(tree: ast.Module):
    """Imports not nested in a function or class body (those are lazy by construction)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []) or []:
                    stack.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _violations() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            allowed = set().union(*(mods for prefix, mods in ALLOWED.items() if rel.startswith(prefix + "/")))
            tree = ast.parse(path.read_text(), filename=rel)
            for lineno, mod in _module_level_imports(tree):
                top = mod.split(".")[0]
                if top in FORBIDDEN[pkg] and top not in allowed:
                    out.append(f"{rel}:{lineno} imports {mod} at module level")
                if pkg == "serve" and top == "agent" and mod not in SERVE_MAY_IMPORT_FROM_AGENT:
                    out.append(f"{rel}:{lineno} imports {mod}; serve may only use agent's protocol modules")
    return out


def test_module_level_imports_follow_the_rules():
    assert _violations() == []


def test_the_checker_catches_a_violation(tmp_path):
    tree = ast.parse("import os\nif True:\n    import torch\ndef f():\n    import serve\n")
    assert [m for _, m in _module_level_imports(tree)] in (["os", "torch"], ["torch", "os"])


def _agent_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages([str(ROOT / "agent")], prefix="agent."):
        if info.name.startswith(("agent.tui", "agent.plain", "agent.acp.")):
            continue
        names.append(info.name)
    return names


def test_importing_the_agent_loads_no_heavy_stack():
    mods = ["agent"] + _agent_modules()
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "heavy = sorted(m for m in ('torch', 'serve', 'train', 'index', 'kernels', 'transformers', "
        "'textual', 'faiss', 'sentence_transformers', 'numpy', 'mcp', 'acp', 'pydantic') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_cli_starts_without_heavy_imports(flag):
    code = (
        "import sys\nfrom agent.cli import main\n"
        f"try:\n    main([{flag!r}])\nexcept SystemExit:\n    pass\n"
        "print('HEAVY=' + ','.join(m for m in ('torch', 'jsonschema', 'textual', 'httpx') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY="


# -- no import circles ------------------------------------------------------------------------------


def _module_file(mod: str) -> Path | None:
    """The file of one of our modules (a package's __init__.py), else None."""
    base = ROOT / mod.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _reexports(init: Path) -> dict[str, str]:
    """name -> the module a package's __init__.py imports it from (`from pkg.sub import name`)."""
    out = {}
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def _import_graph() -> dict[str, set[str]]:
    """file -> files of ours it imports anywhere (module level, in functions, under TYPE_CHECKING): a
    lazy import still ties two files together. `from pkg import name` leads to the submodule `name`, or
    to the module pkg/__init__.py takes `name` from, as a reader would follow it."""
    graph: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            edges = graph.setdefault(rel, set())
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                targets: list[str] = []
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    target = _module_file(node.module)
                    for alias in node.names:
                        sub = f"{node.module}.{alias.name}"
                        if _module_file(sub) is not None:
                            targets.append(sub)
                        elif target is not None and target.name == "__init__.py":
                            targets.append(_reexports(target).get(alias.name, node.module))
                        else:
                            targets.append(node.module)
                for mod in targets:
                    if mod.split(".")[0] in PACKAGES and (f := _module_file(mod)) is not None:
                        other = f.relative_to(ROOT).as_posix()
                        if other != rel:
                            edges.add(other)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_two_files_import_each_other():
    """Files that import each other (directly or round a circle, lazily included) are one piece split in
    two: move what both need to a module both can import (as serve/state.py, agent/errors.py,
    train/rollouts.py and kernels/aligned_pairs.py were made)."""
    assert _circles(_import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}, "d.py": {"a.py"}}) == [
        ["a.py", "b.py", "c.py"]]
