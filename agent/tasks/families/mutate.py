"""Bug injection by AST mutation: the five kinds of the bugfix family, applied to one function and
kept only if the function's own test cases then fail (checked in-process, no subprocess)."""

from __future__ import annotations

import ast
import random
import re
from typing import Any

from agent.tasks.families.pool import Fn

KINDS = ("operator", "constant", "off_by_one", "swap_args", "wrong_variable")
_OPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
        ast.Mod: ast.FloorDiv, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
        ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.And: ast.Or, ast.Or: ast.And}


def _candidates(tree: ast.AST) -> list[tuple[str, int]]:
    """(kind, index of the node in ast.walk order) for every applicable mutation."""
    params = {a.arg for a in tree.body[0].args.args if a.arg not in ('self', 'cls')}
    out = []
    for i, node in enumerate(ast.walk(tree)):
        if isinstance(node, ast.BinOp | ast.BoolOp) and type(node.op) in _OPS:
            out.append(("operator", i))
        elif isinstance(node, ast.Compare) and type(node.ops[0]) in _OPS:
            out.append(("operator", i))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float) and not isinstance(node.value, bool):
            out.append(("constant", i))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and _is_one(node.right):
            out.append(("off_by_one", i))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("range", "len") and node.args:
            out.append(("off_by_one", i))
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and node.slice.upper is not None:
            out.append(("off_by_one", i))
        if isinstance(node, ast.Call) and len(node.args) >= 2 and ast.dump(node.args[0]) != ast.dump(node.args[1]):
            out.append(("swap_args", i))
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in params and len(params) > 1:
            out.append(("wrong_variable", i))
    return out


def _is_one(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 1


def _apply(tree: ast.AST, kind: str, index: int, rng: random.Random) -> None:
    node = list(ast.walk(tree))[index]
    params = sorted(a.arg for a in tree.body[0].args.args if a.arg not in ('self', 'cls'))
    if kind == "operator":
        if isinstance(node, ast.Compare):
            node.ops[0] = _OPS[type(node.ops[0])]()
        else:
            node.op = _OPS[type(node.op)]()
    elif kind == "constant":
        node.value = node.value + 1
    elif kind == "off_by_one":
        if isinstance(node, ast.BinOp):  # x - 1 -> x - 2
            node.right = ast.Constant(2)
        elif isinstance(node, ast.Call):  # range(n) / len(x) -> ... - 1
            node.args[0] = ast.BinOp(node.args[0], ast.Sub(), ast.Constant(1)) if node.func.id == "range" \
                else node.args[0]
            if node.func.id == "len":
                node.func.id = "len"
                node.args[0] = ast.Subscript(node.args[0], ast.Slice(ast.Constant(1), None), ast.Load())
        else:
            node.slice.upper = ast.BinOp(node.slice.upper, ast.Add(), ast.Constant(1))
    elif kind == "swap_args":
        node.args[0], node.args[1] = node.args[1], node.args[0]
    else:
        node.id = rng.choice([p for p in params if p != node.id])


def _breaks(fn: Fn, source: str) -> bool:
    ns: dict[str, Any] = {}
    try:
        exec(compile(source, f"<{fn.name}>", "exec"), ns)  # noqa: S102 - our own generated code
        f = ns[fn.name]
    except Exception:  # noqa: BLE001
        return True
    for args, want in fn.cases:
        try:
            if f(*args) != want:
                return True
        except Exception:  # noqa: BLE001 - a crash is a failing test too
            return True
    return False


def mutations(source: str, rng: random.Random):
    """Every single-point mutation of one function's source, as (kind, mutated source), kinds in a
    seeded order; the source must hold exactly one function definition."""
    tree = ast.parse(source)
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef | ast.AsyncFunctionDef):
        raise ValueError("mutations() takes the source of exactly one function")
    canonical = ast.unparse(tree)
    cands = _candidates(tree)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    for kind in kinds:
        picks = [i for k, i in cands if k == kind]
        rng.shuffle(picks)
        for index in picks:
            t = ast.parse(canonical)
            _apply(t, kind, index, rng)
            bad = ast.unparse(t)
            if bad != canonical:
                yield kind, bad


def inject(fn: Fn, rng: random.Random) -> tuple[str, str] | None:
    """(kind, the function's source with one breaking bug) or None if no mutation breaks a case.
    Kinds are tried in a seeded order, so each kind comes up across seeds."""
    for kind, bad in mutations(fn.canonical, rng):
        if _breaks(fn, bad):
            return kind, bad
    return None


def edit_strings(module_src: str, good: str, bad: str) -> tuple[str, str]:
    """(old, new) for edit_file: the changed lines of the function, with context until unique."""
    g, b = good.splitlines(), bad.splitlines()
    first = next(i for i, (x, y) in enumerate(zip(g, b, strict=False)) if x != y)
    last_g, last_b = len(g) - 1, len(b) - 1
    while last_g > first and last_b > first and g[last_g] == b[last_b]:
        last_g, last_b = last_g - 1, last_b - 1
    start = first
    while module_src.count("\n".join(b[start: last_b + 1])) != 1 and start > 0:
        start -= 1
    return "\n".join(b[start: last_b + 1]), "\n".join(g[start: last_g + 1])


def uses_name(text: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", text) is not None
