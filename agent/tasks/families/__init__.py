"""Synthetic task families, generated from (family, seed, size): small Python repositories with a
verifier the agent never sees, and the plan a scripted expert follows to solve them.

- bugfix    one function has an injected bug (wrong operator, constant, off-by-one, swapped arguments,
            wrong variable) that makes its test fail; "fix it".
- find-def  "where is X defined?"; answered in text, checked against the file.
- rename    rename a function everywhere (definition, callers, tests).
- add-param add a parameter to a function and make its caller use it.

Sizes: small (one module), medium (three), large (five); every repo has `pkg/report.py` calling
every function and tests under `tests/`. Seeds below RENAMED_BASE (100,000) draw their code from the
training pool, seeds from RENAMED_BASE the training pool under fresh module and function names per seed,
seeds from HELDOUT_BASE (1,000,000) on the held-out pool, whose modules and function names the training
split never contains (pool.py). The hidden checker `_hidden/check.py` (plain Python, no pytest)
re-runs every function's cases plus what the family demands. Everything is a function of (family,
seed, size): `generate` gives the Task, `materialize` writes its files (hidden ones only for
verification), `expert_plan` the turns of a correct solution.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.tasks.families import mutate
from agent.tasks.families.pool import HELDOUT, HELDOUT_BASE, TRAIN, Fn, Pool
from agent.tasks.patches import make_patch
from agent.tasks.spec import Task

FAMILIES = ("bugfix", "find-def", "rename", "add-param")
# Generators outside the `synthetic` suites (whose make-up the built-in model's figures rest on).
EXTRA = ("js-bugfix",)
GENERATORS = FAMILIES + EXTRA
SIZES = {"small": 1, "medium": 3, "large": 5}
VERIFY = "python _hidden/check.py"


@dataclass
class Generated:
    files: dict[str, str]
    hidden: dict[str, str]
    prompt: str
    plan: list[dict[str, Any]]  # expert turns: {"content", "reasoning", "tool_calls": [{name, arguments}]}
    meta: dict[str, Any] = field(default_factory=dict)
    expected_tokens: int = 200
    fixed: dict[str, str] = field(default_factory=dict)  # the files a correct solution changes, as it leaves them
    verify: str = VERIFY


def reference_patch(g: Generated) -> str:
    """The known fix as a unified diff ("" for a question: nothing needs to change)."""
    return make_patch({p: g.files[p] for p in g.fixed if p in g.files}, g.fixed)


def generate(family: str, seed: int, size: str = "small", split: str = "") -> Task:
    g = build(family, seed, size)
    return Task(id=f"{family}-{size}-{seed}", prompt=g.prompt, verify=g.verify, generator=family, seed=seed, size=size,
                family=family, tag=size, split=split, expected_tokens=g.expected_tokens, meta=g.meta,
                max_turns=12, max_time_s=300.0, reference_patch=reference_patch(g))


def materialize(task: Task, root: Path, hidden: bool) -> None:
    g = build(task.generator, task.seed, task.size)
    for rel, text in (g.hidden if hidden else g.files).items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def expert_plan(task: Task, mistakes: float = 0.0) -> list[dict[str, Any]]:
    """The expert's turns. With `mistakes` > 0, that share of the tasks whose fix is one edit (chosen by
    the task, not at random per call) gets a first edit whose old_string is not in the file, as a model
    misremembering the line would write it, then the recovery: the same edit with the line copied as the
    file has it (the edit tool's error shows it). The failed turn is marked {"mistake": True}."""
    g = build(task.generator, task.seed, task.size)
    if mistakes <= 0:
        return g.plan
    rng = random.Random(f"mistake:{task.generator}:{task.size}:{task.seed}")
    if rng.random() >= mistakes:
        return g.plan
    for i, turn in enumerate(g.plan):
        calls = turn.get("tool_calls") or []
        if len(calls) == 1 and calls[0]["name"] == "edit_file":
            args = calls[0]["arguments"]
            wrong = _misremembered(args["old_string"], args["new_string"], g.files.get(args["path"], ""), rng)
            if wrong is None:
                return g.plan
            bad = {**turn, "tool_calls": [_call("edit_file", **{**args, "old_string": wrong})], "mistake": True}
            fixed = {"reasoning": "That old_string is not in the file: copy the line exactly as the file has it.",
                     "tool_calls": calls}
            return [*g.plan[:i], bad, fixed, *g.plan[i + 1:]]
    return g.plan


_SWAPS = {"+": "-", "-": "+", "*": "+", "/": "*", "<": ">", ">": "<", "=": "!"}


def _misremembered(old: str, new: str, source: str, rng: random.Random) -> str | None:
    """An old_string close to `old` but not in `source`: the fixed text (recalled instead of copied) or
    `old` with one character changed (a digit, an operator or a letter)."""
    candidates = [new] if rng.random() < 0.5 else []
    spots = [i for i, c in enumerate(old) if c.isalnum() or c in _SWAPS]
    for i in rng.sample(spots, min(len(spots), 8)):
        c = old[i]
        if c.isdigit():
            r = str((int(c) + rng.randrange(1, 10)) % 10)
        elif c in _SWAPS:
            r = _SWAPS[c]
        else:
            r = rng.choice([x for x in "abcdefghijklmnopqrstuvwxyz" if x != c.lower()])
        candidates.append(old[:i] + r + old[i + 1:])
    return next((w for w in candidates if w and w != old and w not in source), None)


# -- the repository ------------------------------------------------------------------------------------


RENAMED_BASE = 100_000


def pool_for(seed: int) -> Pool:
    """The code a seed's task is built from: seeds below RENAMED_BASE the training pool as it is, seeds
    from RENAMED_BASE the training pool under fresh names per seed, seeds from HELDOUT_BASE the held-out
    pool (no function or module shared with training)."""
    if seed >= HELDOUT_BASE:
        return HELDOUT
    return TRAIN.renamed(seed) if seed >= RENAMED_BASE else TRAIN


def _modules(pool: Pool, rng: random.Random, size: str, must: str | None = None) -> list[str]:
    names = sorted(pool.modules)
    rng.shuffle(names)
    if must is not None:
        names.remove(must)
        names.insert(0, must)
    return names[: SIZES[size]]


def _repo(pool: Pool, modules: list[str], sources: dict[str, str] | None = None,
          report_calls: dict[str, str] | None = None) -> dict[str, str]:
    """Files of the repo: pkg modules (sources override), report.py, visible tests, README."""
    files = {"pkg/__init__.py": "", "README.md": f"# pkg\n\nSmall utilities: {', '.join(modules)}.\n"}
    report_imports, report_lines = [], []
    for m in modules:
        fns = pool.modules[m]
        files[f"pkg/{m}.py"] = (sources or {}).get(m) or "\n\n".join(fn.canonical for fn in fns) + "\n"
        tests = [f"from pkg.{m} import {', '.join(fn.name for fn in fns)}\n"]
        for fn in fns:
            body = "".join(f"    assert {fn.name}({_args(a)}) == {e!r}\n" for a, e in fn.cases)
            tests.append(f"\ndef test_{fn.name}():\n{body}")
        files[f"tests/test_{m}.py"] = "\n".join(tests)
        report_imports.append(f"from pkg.{m} import {', '.join(fn.name for fn in fns)}")
        for fn in fns:
            call = (report_calls or {}).get(fn.name) or f"{fn.name}({_args(fn.cases[0][0])})"
            report_lines.append(f"        {fn.name!r}: {call},")
    files["pkg/report.py"] = ("\n".join(report_imports) + "\n\n\ndef summary():\n    return {\n"
                              + "\n".join(report_lines) + "\n    }\n")
    return files


def _args(args: tuple) -> str:
    return ", ".join(repr(a) for a in args)


def _checker(cases: list[tuple[str, str, tuple, Any]], extra: str = "") -> dict[str, str]:
    """_hidden/check.py: call each (module, function, args) and compare; plus `extra` checks."""
    return {"_hidden/check.py": (
        "import importlib, json, sys\nsys.path.insert(0, '.')\n"
        f"CASES = json.loads({json.dumps(json.dumps([[m, f, list(a), e] for m, f, a, e in cases]))})\n"
        "bad = []\nfor mod, fn, args, want in CASES:\n"
        "    try:\n        got = getattr(importlib.import_module('pkg.' + mod), fn)(*args)\n"
        "    except Exception as e:\n        got = repr(e)\n"
        "    if isinstance(want, list) and isinstance(got, tuple):\n        got = list(got)\n"
        "    if got != want:\n        bad.append(f'{mod}.{fn}{tuple(args)} = {got!r}, expected {want!r}')\n"
        + extra + "print('\\n'.join(bad) or 'ok')\nsys.exit(1 if bad else 0)\n")}


def _all_cases(pool: Pool, modules: list[str]) -> list[tuple[str, str, tuple, Any]]:
    return [(m, fn.name, a, e) for m in modules for fn in pool.modules[m] for a, e in fn.cases]


def _call(name: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "arguments": args}


def _test_cmd(module: str) -> str:
    return f"python -m pytest -q -p no:cacheprovider tests/test_{module}.py"


# -- families ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def build(family: str, seed: int, size: str) -> Generated:
    """The generated task (cached: an episode asks for it to write the files, the hidden files and,
    with the expert, the plan; callers must not modify what it returns)."""
    if family == "js-bugfix":
        from agent.tasks.families.js import build_js

        return Generated(**build_js(seed, size))
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(GENERATORS)})")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (known: {', '.join(SIZES)})")
    rng = random.Random(f"{family}:{size}:{seed}")
    make = {"bugfix": _bugfix, "find-def": _find_def, "rename": _rename, "add-param": _add_param}[family]
    return make(pool_for(seed), rng, size)


def _bugfix(pool: Pool, rng: random.Random, size: str) -> Generated:
    modules = _modules(pool, rng, size)
    target_mod = modules[rng.randrange(len(modules))]
    fns = pool.modules[target_mod]
    order = list(range(len(fns)))
    rng.shuffle(order)
    for i in order:
        fn = fns[i]
        bug = mutate.inject(fn, rng)
        if bug is not None:
            break
    else:  # every function of the pool has at least one breaking mutation: cannot happen
        raise RuntimeError(f"no breaking mutation in {target_mod}")
    kind, bad_source = bug
    module_src = "\n\n".join(bad_source if f is fn else f.canonical for f in fns) + "\n"
    files = _repo(pool, modules, {target_mod: module_src})
    path = f"pkg/{target_mod}.py"
    old, new = mutate.edit_strings(module_src, fn.canonical, bad_source)
    prompt = rng.choice([f"tests/test_{target_mod}.py is failing, can you fix it?",
                         f"something's wrong with {fn.name}() — the tests fail. fix the bug, not the tests",
                         f"test_{fn.name} fails. please fix"])
    plan = [
        {"reasoning": f"Run the failing tests and read {path} at the same time.",
         "tool_calls": [_call("shell", command=_test_cmd(target_mod)), _call("read_file", path=path)]},
        {"reasoning": f"{fn.name} has a {kind.replace('_', ' ')} bug.", "tool_calls": [
            _call("edit_file", path=path, old_string=old, new_string=new)]},
        {"tool_calls": [_call("shell", command=_test_cmd(target_mod))]},
        {"content": f"Fixed `{fn.name}` in {path}: the {kind.replace('_', ' ')} is corrected and the tests pass."},
    ]
    fixed = {path: "\n\n".join(f.canonical for f in fns) + "\n"}
    return Generated(files, _checker(_all_cases(pool, modules)), prompt, plan,
                     {"function": fn.name, "module": path, "mutation": kind}, expected_tokens=250, fixed=fixed)


def _find_def(pool: Pool, rng: random.Random, size: str) -> Generated:
    modules = _modules(pool, rng, size)
    target_mod = modules[rng.randrange(len(modules))]
    fn = rng.choice(pool.modules[target_mod])
    files = _repo(pool, modules)
    path = f"pkg/{target_mod}.py"
    line = files[path].splitlines().index(next(ln for ln in files[path].splitlines()
                                               if ln.startswith(f"def {fn.name}("))) + 1
    prompt = rng.choice([f"where is {fn.name} defined?", f"which file has the definition of `{fn.name}`?",
                         f"find where {fn.name} is implemented"])
    # Naming every module is not an answer (RL learnt to list them all when this only checked `path`).
    extra = (f"answer = open(__import__('os').environ['COMPOSER_ANSWER_FILE']).read()\n"
             f"if {path!r} not in answer:\n    bad.append('the answer does not name {path}')\n"
             f"others = sorted(set(__import__('re').findall(r'pkg/\\w+\\.py', answer)) - {{{path!r}}})\n"
             f"if others:\n    bad.append(f'the answer also names {{others}}')\n")
    # content mode, so the line the answer names is one the tools showed (the claims check wants evidence)
    plan = [{"tool_calls": [_call("grep", pattern=f"def {fn.name}\\(", output_mode="content")]},
            {"content": f"`{fn.name}` is defined in {path}, line {line}."}]
    return Generated(files, _checker(_all_cases(pool, modules), extra), prompt, plan,
                     {"function": fn.name, "module": path, "line": line}, expected_tokens=60)


def _rename(pool: Pool, rng: random.Random, size: str) -> Generated:
    modules = _modules(pool, rng, size)
    target_mod = modules[rng.randrange(len(modules))]
    fn = rng.choice(pool.modules[target_mod])  # report.py calls it too: there are callers to update
    new = rng.choice(["compute_", "calc_", "get_"]) + fn.name
    files = _repo(pool, modules)
    users = sorted(p for p, text in files.items() if mutate.uses_name(text, fn.name))
    cases = [(m, new if f == fn.name else f, a, e) for m, f, a, e in _all_cases(pool, modules)]
    extra = ("import pathlib, re\n"
             f"for p in list(pathlib.Path('pkg').rglob('*.py')) + list(pathlib.Path('tests').rglob('*.py')):\n"
             f"    if re.search(r'\\b{fn.name}\\b', p.read_text()):\n"
             f"        bad.append(f'{{p}} still mentions {fn.name}')\n"
             f"rep = importlib.import_module('pkg.report').summary()\n"
             f"if rep.get({new!r}) != {fn.cases[0][1]!r}:\n    bad.append('report.summary() changed')\n")
    prompt = rng.choice([f"rename {fn.name} to {new} everywhere", f"can you rename `{fn.name}` -> `{new}`? "
                         "callers and tests too"])
    sed = f"sed -i 's/\\b{fn.name}\\b/{new}/g' " + " ".join(users)
    plan = [{"tool_calls": [_call("grep", pattern=f"\\b{fn.name}\\b")]},
            {"reasoning": f"{len(users)} files use it; rename them all in one go.",
             "tool_calls": [_call("shell", command=sed)]},
            {"tool_calls": [_call("grep", pattern=f"\\b{fn.name}\\b"), _call("shell", command="python -m pytest -q -p no:cacheprovider tests")]},
            {"content": f"Renamed `{fn.name}` to `{new}` in {', '.join(users)}; the tests pass."}]
    fixed = {p: re.sub(rf"\b{re.escape(fn.name)}\b", new, files[p]) for p in users}
    return Generated(files, _checker(cases, extra), prompt, plan,
                     {"function": fn.name, "new_name": new, "files": users}, expected_tokens=200, fixed=fixed)


def _add_param(pool: Pool, rng: random.Random, size: str) -> Generated:
    name, param, default, desc, new_source, extra_cases = pool.add_param[rng.randrange(len(pool.add_param))]
    target_mod, fn = pool.find(name)
    modules = _modules(pool, rng, size, must=target_mod)
    args, want = extra_cases[0]
    call_args = list(args)
    value = call_args.pop()
    positional = _args(tuple(call_args))
    new_call = f"{name}({positional}, {param}={value!r})"
    files = _repo(pool, modules)
    path = f"pkg/{target_mod}.py"
    old_call = f"{name}({_args(fn.cases[0][0])})"
    new_canonical = Fn(name, new_source, ()).canonical
    cases = _all_cases(pool, modules) + [(target_mod, name, a, e) for a, e in extra_cases]
    extra = (f"rep = importlib.import_module('pkg.report').summary()\n"
             f"if rep.get({name!r}) != {want!r}:\n"
             f"    bad.append('report.summary()[%r] = %r, expected %r' % ({name!r}, rep.get({name!r}), {want!r}))\n")
    prompt = rng.choice([f"give {name}() {desc}, and make report.summary() call it with {param}={value!r}",
                         f"{name} needs {desc}. update the caller in report.py to pass {param}={value!r}"])
    plan = [{"tool_calls": [_call("read_file", path=path), _call("read_file", path="pkg/report.py")]},
            {"tool_calls": [_call("edit_file", path=path, old_string=fn.canonical, new_string=new_canonical),
                            _call("edit_file", path="pkg/report.py", old_string=old_call, new_string=new_call)]},
            {"tool_calls": [_call("shell", command="python -m pytest -q -p no:cacheprovider tests")]},
            {"content": f"`{name}` now takes `{param}` (default {default}); report.summary() passes {param}={value!r}."}]
    fixed = {path: files[path].replace(fn.canonical, new_canonical, 1),
             "pkg/report.py": files["pkg/report.py"].replace(old_call, new_call, 1)}
    return Generated(files, _checker(cases, extra), prompt, plan,
                     {"function": name, "param": param, "module": path}, expected_tokens=220, fixed=fixed)
