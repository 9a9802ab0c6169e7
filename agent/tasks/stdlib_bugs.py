"""Bug injection into real code with real tests: the standard library and its own `test` package.

    python -m agent.tasks.stdlib_bugs --out DIR [--max N] [--modules a,b] [--seed S] [--jobs J]

For each module (a pure-Python stdlib module `X` with a test module `test/test_X.py`):

1. a scratch workspace gets a copy of the module (top level, a file or a package folder) and of the
   test file; the test runs there once (the unmodified copy must pass) under a profiler that records
   which of the module's functions the tests call, and checks that the copy really shadows the
   stdlib's (a module imported at interpreter start-up, or by unittest itself, cannot be: skipped);
2. called functions are taken in a seeded order, each mutated with `families.mutate.mutations()`
   (operator, constant, off_by_one, swap_args, wrong_variable); the mutated node's source text alone is
   replaced in the module (comments and layout stay, the result is checked against the mutated AST),
   and the test module is run again: a mutation is kept when 1..--max-failing tests fail, all of them
   real tests of the module, the same ones on a second run (no flaky ones, no time-outs);
3. a task is written: DIR/workspaces/<id>/ (the mutated module + the test file), DIR/hidden/<id>/ (a
   pristine copy of the test file, put back before verification so editing the test cannot pass), and
   a line in DIR/tasks.jsonl whose prompt is a short user report made from the first failing test's
   output, and whose `reference_patch` undoes the mutation. Verify runs the whole test module (`python -m unittest test_X`), so the fix must keep the
   module's other tests passing.

Everything is a function of the seed and of the Python version the tests come from (the verify
command refuses another minor version). Generation runs real tests: bounded by --max, by
--per-module, by the tries per function and by a per-run time-out; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.tasks.families.mutate import mutations
from agent.tasks.patches import make_patch
from agent.tasks.spec import Task, write_tasks

FAMILY = "stdlib-bug"
# Modules whose tests run in seconds, pass on a copy, and write nothing outside their folder, fastest
# and most familiar first (measured on Python 3.11; `--modules all` scans every stdlib module that has a
# single-file test module, minus DENY; modules imported at start-up, e.g. by .pth files, are skipped).
DEFAULT_MODULES = (
    "textwrap", "colorsys", "fractions", "string", "html", "shlex", "calendar", "difflib", "base64", "quopri",
    "getopt", "optparse", "configparser", "graphlib", "stringprep", "netrc", "mimetypes", "plistlib", "cmd",
    "sched", "glob", "bisect", "heapq", "csv", "copy", "codeop", "filecmp", "fileinput", "symtable", "timeit",
    "pstats", "wave", "sunau", "aifc", "zipapp", "modulefinder", "rlcompleter", "random", "pyclbr", "xdrlib",
    "uu", "imghdr", "sndhdr", "mailcap", "pipes", "cgi", "cgitb", "pickletools", "argparse", "statistics",
)
# Never mutated: destructive when broken (they delete or write files, spawn processes), talk to the
# network, need a terminal or a display, or are the test machinery itself.
DENY = frozenset({
    "os", "shutil", "tempfile", "subprocess", "signal", "pty", "tty", "socket", "socketserver", "ssl",
    "selectors", "ftplib", "imaplib", "poplib", "smtplib", "smtpd", "nntplib", "telnetlib", "urllib",
    "webbrowser", "turtle", "curses", "ensurepip", "venv", "site", "unittest", "doctest", "threading",
    "compileall", "py_compile", "zipimport", "crypt", "getpass", "pdb", "bdb", "trace", "profile",
    "tracemalloc", "distutils", "lib2to3", "ctypes", "asyncore", "asynchat", "xmlrpc", "wsgiref",
    "logging", "multiprocessing", "concurrent", "asyncio", "sqlite3", "idlelib", "tkinter", "dbm",
    "shelve", "mailbox", "tarfile", "zipfile", "gzip", "bz2", "lzma", "pydoc", "runpy", "pkgutil",
    "sysconfig", "platform", "locale", "gettext", "hashlib", "hmac", "io", "codecs", "types", "typing",
    "weakref", "operator", "functools", "collections", "enum", "re", "abc", "copyreg", "stat",
    "linecache", "traceback", "struct", "queue", "datetime", "decimal", "pickle", "ast", "inspect",
})
TEMPLATES = (
    "test_{mod} fails: {exc} in {test}. can you fix it?",
    "`python -m unittest test_{mod}` is red since my last change, {test} fails with:\n{line}\nplease fix the code, "
    "the test is right",
    "{test} in test_{mod}.py started failing ({exc}). fix it?",
    "getting {nfail} in test_{mod}, e.g. {cls}.{test}:\n{line}\ncan you take a look?",
    "something broke, test_{mod} says {line}\n(in {test}). find the bug and fix it, don't touch the test",
)

# Runs in the workspace as `python -c HARNESS TEST_MODULE TARGET OUT.json [profile FILE...]`: what
# `python -m unittest TEST_MODULE` runs (same sys.path[0], same start-up imports), with results as JSON.
HARNESS = r"""
import os, sys, io, unittest
test_mod, target, out = sys.argv[1:4]
profile = sys.argv[4:5] == ["profile"]
files = {os.path.abspath(f) for f in sys.argv[5:]}
called = set()
def _prof(frame, event, arg):
    if event == "call":
        co = frame.f_code
        f = os.path.abspath(co.co_filename)
        if f in files:
            called.add((f, co.co_qualname))
preloaded = target in sys.modules
if profile:
    sys.setprofile(_prof)
try:
    prog = unittest.main(module=None, argv=["python -m unittest", test_mod], exit=False,
                         testRunner=unittest.TextTestRunner(stream=io.StringIO(), verbosity=0))
finally:
    sys.setprofile(None)
r = prog.result
def _entry(kind, test, tb=""):
    parent = getattr(test, "test_case", test)
    return {"kind": kind, "id": test.id(), "parent": parent.id(), "traceback": tb[-4000:]}
fails = [_entry("failure", t, tb) for t, tb in r.failures] + [_entry("error", t, tb) for t, tb in r.errors]
fails += [_entry("unexpected_success", t) for t in r.unexpectedSuccesses]
m = sys.modules.get(target)
mfile = os.path.abspath(getattr(m, "__file__", None) or "")
import json
with open(out, "w") as f:
    json.dump({"tests_run": r.testsRun, "ok": r.wasSuccessful(), "failures": fails, "preloaded": preloaded,
               "module_file": mfile, "shadowed": mfile.startswith(os.getcwd() + os.sep),
               "called": sorted(called)}, f)
"""


class Skip(Exception):
    """A module that cannot be used (the message says why)."""


@dataclass
class RunResult:
    ok: bool
    tests_run: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    shadowed: bool = False
    called: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    timed_out: bool = False
    crashed: str = ""

    @property
    def failing(self) -> list[str]:
        """Ids of the failing tests (a failing subtest counts as its test), sorted, unique."""
        return sorted({f["parent"] for f in self.failures})


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_source(name: str) -> Path:
    """The stdlib file or package folder of module `name`."""
    base = stdlib_dir()
    if (base / f"{name}.py").is_file():
        return base / f"{name}.py"
    if (base / name / "__init__.py").is_file():
        return base / name
    raise Skip(f"{name}: not a pure-Python module of the standard library")


def test_file_of(name: str) -> Path:
    p = stdlib_dir() / "test" / f"test_{name}.py"
    if not p.is_file():
        raise Skip(f"{name}: no single-file test module test/test_{name}.py")
    return p


def candidates() -> list[str]:
    """Every stdlib module with a single-file test module, minus DENY."""
    base = stdlib_dir()
    out = []
    for t in sorted((base / "test").glob("test_*.py")):
        name = t.stem[5:]
        if name not in DENY and ((base / f"{name}.py").is_file() or (base / name / "__init__.py").is_file()):
            out.append(name)
    return out


def copy_module(name: str, dest: Path) -> list[str]:
    """Copy module `name` (and its test file) into `dest`; the module's .py files, relative to dest."""
    src = module_source(name)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(test_file_of(name), dest / f"test_{name}.py")
    if src.is_file():
        shutil.copy2(src, dest / src.name)
        return [src.name]
    shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    return sorted(str(p.relative_to(dest)) for p in (dest / name).rglob("*.py"))


def _test_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    for k in ("PYTHONSAFEPATH", "PYTHONSTARTUP", "PYTHONINSPECT"):
        env.pop(k, None)
    return env


def run_tests(root: Path, name: str, timeout_s: float = 60.0, profile_files: list[str] | None = None,
              python: str | None = None) -> RunResult:
    """Run test_<name> in `root` as `python -m unittest` would, killed with its children at the time-out."""
    with tempfile.TemporaryDirectory(prefix="stdlib-bugs-run-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [python or sys.executable, "-c", HARNESS, f"test_{name}", name, str(out)]
        if profile_files is not None:
            argv += ["profile", *profile_files]
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=_test_env(), start_new_session=True, text=True,
                                errors="replace")
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return RunResult(False, seconds=time.monotonic() - t0, timed_out=True)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the tests left running
            except ProcessLookupError:
                pass
        seconds = time.monotonic() - t0
        if not out.is_file():
            return RunResult(False, seconds=seconds, crashed=(err or "")[-1000:] or f"exit {proc.returncode}")
        data = json.loads(out.read_text())
    return RunResult(bool(data["ok"]), data["tests_run"], data["failures"], bool(data["shadowed"]),
                     [tuple(c) for c in data["called"]], seconds)


# -- mutating one function in place ----------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    file: str
    """The module file, relative to the workspace."""
    qualname: str
    """`func` or `Class.method` (top level only, as co_qualname names them)."""
    lineno: int
    """The `def` line, 1-based."""
    end_lineno: int


def targets(text: str, file: str) -> list[Target]:
    """Top-level functions and methods of top-level classes, unambiguous by qualname."""
    found: dict[str, list[ast.AST]] = {}
    for qualname, node in _functions(ast.parse(text)):
        found.setdefault(qualname, []).append(node)
    return [Target(file, q, ns[0].lineno, ns[0].end_lineno) for q, ns in found.items() if len(ns) == 1]


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{sub.name}", sub


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    return next((node for q, node in _functions(tree) if q == qualname), None)


def _signature(fn: ast.AST) -> list[str]:
    """The function without its name, decorators and positions (what a mutation may change)."""
    return [ast.dump(fn.args), *(ast.dump(s) for s in fn.body), ast.dump(fn.returns) if fn.returns else ""]


def _changed(a: ast.AST, b: ast.AST) -> tuple[ast.AST, ast.AST]:
    """The smallest positioned node of `a` whose counterpart in `b` differs (trees equal elsewhere)."""
    diffs = []
    for name, va in ast.iter_fields(a):
        vb = getattr(b, name, None)
        if isinstance(va, list) != isinstance(vb, list) or (isinstance(va, list) and len(va) != len(vb)):
            return a, b
        for x, y in zip(va, vb, strict=True) if isinstance(va, list) else [(va, vb)]:
            if isinstance(x, ast.AST) and isinstance(y, ast.AST):
                if ast.dump(x) != ast.dump(y):
                    diffs.append((x, y))
            elif type(x) is not type(y) or x != y:
                return a, b
    if len(diffs) == 1 and hasattr(diffs[0][0], "end_col_offset"):
        x, y = diffs[0]
        return _changed(x, y) if type(x) is type(y) else (x, y)
    return a, b


def _byte_offset(lines: list[bytes], lineno: int, col: int) -> int:
    return sum(len(s) for s in lines[: lineno - 1]) + col


def splice(text: str, target: Target, bad_function: str) -> str | None:
    """`text` with `target`'s function changed into `bad_function` (the mutated, dedented source that
    `mutations()` returned) by rewriting only the changed node's text; None when that cannot be done
    faithfully (the result is checked against the mutated AST)."""
    lines = text.splitlines(keepends=True)
    func = lines[target.lineno - 1: target.end_lineno]
    prefix = func[0][: len(func[0]) - len(func[0].lstrip(" \t"))]
    stripped = [ln.startswith(prefix) for ln in func]
    if not all(s or not ln.strip() for s, ln in zip(stripped, func, strict=True)):
        return None
    dedented = "".join(ln[len(prefix):] if s else ln for s, ln in zip(stripped, func, strict=True))
    try:
        orig_tree, bad_tree = ast.parse(dedented), ast.parse(bad_function)
    except SyntaxError:
        return None
    if ast.dump(orig_tree) != ast.dump(ast.parse(ast.unparse(orig_tree))):
        return None  # the round trip through ast.unparse changes it: positions would not line up
    node, new = _changed(orig_tree.body[0], bad_tree.body[0])
    if not hasattr(node, "end_col_offset") or node is orig_tree.body[0]:
        return None
    blines = [ln.encode() for ln in lines]
    pad = len(prefix.encode())

    def pos(lineno: int, col: int) -> int:
        mod_line = target.lineno + lineno - 1
        return _byte_offset(blines, mod_line, col + (pad if stripped[lineno - 1] else 0))

    start, end = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
    raw = b"".join(blines)
    replacement = ast.unparse(new).encode()
    candidates = []
    if isinstance(node, ast.Call) and isinstance(new, ast.Call) and len(node.args) >= 2 \
            and ast.dump(node.args[0]) == ast.dump(new.args[1]) and ast.dump(node.args[1]) == ast.dump(new.args[0]):
        a0, a1 = node.args[0], node.args[1]  # swapped arguments: swap their text, keep the call's layout
        s0, e0 = pos(a0.lineno, a0.col_offset), pos(a0.end_lineno, a0.end_col_offset)
        s1, e1 = pos(a1.lineno, a1.col_offset), pos(a1.end_lineno, a1.end_col_offset)
        candidates.append(raw[:s0] + raw[s1:e1] + raw[e0:s1] + raw[s0:e0] + raw[e1:])
    # the node's text replaced; in parentheses when precedence demands it (c - a * b -> c - (a + b))
    candidates += [raw[:start] + replacement + raw[end:], raw[:start] + b"(" + replacement + b")" + raw[end:]]
    want = _signature(bad_tree.body[0])
    for cand in candidates:
        out = cand.decode()
        try:
            fn = _find(ast.parse(out), target.qualname)
            if fn is None:
                continue
            # dedented the same way, so that strings spanning lines compare equal too
            got = _dedent(out.splitlines(keepends=True)[fn.lineno - 1: fn.end_lineno], prefix)
            if got is not None and _signature(ast.parse(got).body[0]) == want:
                return out
        except SyntaxError:
            continue
    return None


def _dedent(func: list[str], prefix: str) -> str | None:
    """The function's lines without `prefix` (lines that lack it must be blank), or None."""
    if not all(ln.startswith(prefix) or not ln.strip() for ln in func):
        return None
    return "".join(ln[len(prefix):] if ln.startswith(prefix) else ln for ln in func)


def mutants(text: str, target: Target, rng: random.Random) -> Iterator[tuple[str, str]]:
    """(kind, the module's text with one bug in `target`) in a seeded order."""
    func = text.splitlines(keepends=True)[target.lineno - 1: target.end_lineno]
    dedented = _dedent(func, func[0][: len(func[0]) - len(func[0].lstrip(" \t"))])
    if dedented is None:
        return
    try:
        muts = mutations(dedented, rng)
        for kind, bad in muts:
            out = splice(text, target, bad)
            if out is not None and out != text:
                yield kind, out
    except (SyntaxError, ValueError):
        return


# -- generation ------------------------------------------------------------------------------------


@dataclass
class Found:
    module: str
    target: Target
    kind: str
    text: str
    """The mutated module file."""
    result: RunResult
    baseline: RunResult
    diff_line: int


def _exception_line(tb: str) -> str:
    """The exception line of a traceback ("AssertionError: 3 != 4"), of its last chained part."""
    lines = tb.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    for ln in lines[(starts[-1] + 1) if starts else 0:]:
        if ln and not ln[0].isspace():
            return ln.strip()
    return lines[-1].strip() if lines else "an error"


def prompt_for(module: str, failing: list[dict[str, Any]], rng: random.Random) -> str:
    first = failing[0]
    parent = first["parent"]
    parts = parent.split(".")
    test, cls = parts[-1].split(" ")[0], parts[-2] if len(parts) >= 2 else ""
    line = _exception_line(first.get("traceback") or "") if first["kind"] != "unexpected_success" \
        else "unexpected success"
    line = line if len(line) <= 160 else line[:157] + "..."
    exc = line.split(":", 1)[0]
    n = len({f["parent"] for f in failing})
    nfail = f"{n} failure{'s' if n > 1 else ''}"
    return rng.choice(TEMPLATES).format(mod=module, exc=exc, test=test, cls=cls, line=line, nfail=nfail)


def scan_module(name: str, seed: int, per_module: int, tries_per_function: int, max_failing: int,
                timeout_s: float, log=None) -> tuple[list[Found], str]:
    """Up to `per_module` kept mutations of module `name`, and a one-line summary."""
    log = log or (lambda s: None)
    t0 = time.monotonic()
    rng = random.Random(f"{seed}/{name}")
    with tempfile.TemporaryDirectory(prefix=f"stdlib-bugs-{name}-") as tmp:
        root = Path(tmp) / "ws"
        files = copy_module(name, root)
        base = run_tests(root, name, timeout_s, profile_files=files)
        if base.timed_out:
            raise Skip(f"{name}: its tests take more than {timeout_s:g} s")
        if base.crashed or base.tests_run == 0:
            raise Skip(f"{name}: the tests do not run ({base.crashed.strip().splitlines()[-1:] or 'no tests'})")
        if not base.shadowed:
            raise Skip(f"{name}: a copy in the workspace does not shadow the stdlib's (imported at start-up)")
        if not base.ok:
            raise Skip(f"{name}: {len(base.failing)} tests fail on the unmodified copy")
        called: dict[str, set[str]] = {}
        for f, q in base.called:
            called.setdefault(str(Path(f).resolve().relative_to(root.resolve())), set()).add(q)
        texts = {f: (root / f).read_text(encoding="utf-8") for f in files}
        pool = [t for f in files if f in called for t in targets(texts[f], f) if t.qualname in called[f]]
        pool.sort(key=lambda t: (t.file, t.lineno))
        rng.shuffle(pool)
        limit = max(10.0, min(timeout_s, 5 * base.seconds + 5))
        found: list[Found] = []
        runs = 0
        for target in pool:
            if len(found) >= per_module:
                break
            original = texts[target.file]
            for n, (kind, text) in enumerate(mutants(original, target, rng)):
                if n >= tries_per_function:
                    break
                (root / target.file).write_text(text, encoding="utf-8")
                try:
                    res = run_tests(root, name, limit)
                    runs += 1
                    ok = _usable(res, name, max_failing)
                    if ok:  # the same tests fail again: not flaky
                        again = run_tests(root, name, limit)
                        runs += 1
                        ok = _usable(again, name, max_failing) and again.failing == res.failing
                finally:
                    (root / target.file).write_text(original, encoding="utf-8")
                if ok:
                    line = _first_diff_line(original, text)
                    found.append(Found(name, target, kind, text, res, base, line))
                    log(f"  {name}: {target.qualname} ({kind}) breaks {', '.join(res.failing)}")
                    break
    summary = (f"{name}: {len(found)} tasks from {runs} test runs, {len(pool)} called functions, "
               f"baseline {base.tests_run} tests in {base.seconds:.1f} s; {time.monotonic() - t0:.0f} s")
    return found, summary


def _usable(res: RunResult, name: str, max_failing: int) -> bool:
    if res.ok or res.timed_out or res.crashed or not res.failures:
        return False
    ids = res.failing
    return len(ids) <= max_failing and all(i.startswith(f"test_{name}.") and "_FailedTest" not in i for i in ids)


def _first_diff_line(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines(), strict=False), 1):
        if x != y:
            return i
    return 0


def verify_command(name: str) -> str:
    """The whole test module, run as the user would; first a guard that fails when the tests come from
    another Python version or when `name` would not be the workspace's copy (the stdlib's would pass)."""
    major, minor = sys.version_info[:2]
    guard = (f"python -c \"import os, sys, {name}; sys.exit('these tasks need Python {major}.{minor}' "
             f"if sys.version_info[:2] != ({major}, {minor}) else '{name} is not the copy in this folder' "
             f"if not os.path.abspath({name}.__file__).startswith(os.getcwd() + os.sep) else 0)\"")
    return f"{guard} && python -m unittest -q test_{name}"


def write_task(out: Path, found: Found, index: int, seed: int, split: str = "") -> Task:
    name = found.module
    tid = f"stdlib-{name}-{index}"
    ws, hidden = out / "workspaces" / tid, out / "hidden" / tid
    for d in (ws, hidden):
        if d.exists():
            shutil.rmtree(d)
    copy_module(name, ws)
    pristine = (ws / found.target.file).read_text(encoding="utf-8")
    (ws / found.target.file).write_text(found.text, encoding="utf-8")
    hidden.mkdir(parents=True)
    shutil.copy2(test_file_of(name), hidden / f"test_{name}.py")
    rng = random.Random(f"{seed}/{tid}/prompt")
    prompt = prompt_for(name, found.result.failures, rng)
    return Task(id=tid, prompt=prompt, verify=verify_command(name), workspace=f"workspaces/{tid}",
                hidden=f"hidden/{tid}", max_turns=20, max_time_s=600.0,
                verify_timeout_s=float(max(60, round(10 * found.baseline.seconds))), family=FAMILY,
                tag=found.kind, split=split,
                reference_patch=make_patch({found.target.file: found.text}, {found.target.file: pristine}),
                meta={"module": name, "file": found.target.file, "function": found.target.qualname,
                      "mutation": found.kind, "line": found.diff_line, "test_module": f"test_{name}",
                      "failing_tests": found.result.failing, "tests": found.baseline.tests_run,
                      "python": ".".join(map(str, sys.version_info[:3])), "seed": seed})


def build(out: str | Path, modules: list[str] | None = None, max_tasks: int = 40, seed: int = 0,
          per_module: int = 3, tries_per_function: int = 3, max_failing: int = 10, timeout_s: float = 60.0,
          jobs: int = 1, split: str = "", log=None) -> list[Task]:
    """Generate up to `max_tasks` tasks into `out` (tasks.jsonl, workspaces/, hidden/); deterministic
    for a seed. Modules are taken in order; the last ones are not scanned once enough tasks are found."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    out = Path(out)
    names = list(modules or DEFAULT_MODULES)
    t0 = time.monotonic()
    pending: list[tuple[str, Future]] = []
    results: list[list[Found]] = []
    total = 0
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        it = iter(names)
        while True:
            while total < max_tasks and len(pending) < max(1, jobs):
                name = next(it, None)
                if name is None:
                    break
                pending.append((name, ex.submit(_scan_or_skip, name, seed, per_module, tries_per_function,
                                                max_failing, timeout_s, log)))
            if not pending:
                break
            name, fut = pending.pop(0)
            found, summary = fut.result()
            results.append(found)
            total += len(found)
            log(f"[{len(results)}/{len(names)}] {summary} (total {min(total, max_tasks)}/{max_tasks}, "
                f"{time.monotonic() - t0:.0f} s)")
            if total >= max_tasks:
                for _, f in pending:
                    f.cancel()
                pending = []  # the order-prefix is complete: later modules are not needed
                break
    tasks: list[Task] = []
    counts: dict[str, int] = {}
    for found in (f for group in results for f in group):
        if len(tasks) >= max_tasks:
            break
        counts[found.module] = counts.get(found.module, 0) + 1
        tasks.append(write_task(out, found, counts[found.module], seed, split))
    write_tasks(tasks, out / "tasks.jsonl")
    log(f"{len(tasks)} tasks from {len(results)} modules in {time.monotonic() - t0:.0f} s: {out / 'tasks.jsonl'}")
    return tasks


def _scan_or_skip(name: str, *args: Any) -> tuple[list[Found], str]:
    try:
        if name in DENY:
            raise Skip(f"{name}: on the deny list (destructive, networked or test machinery when broken)")
        return scan_module(name, *args)
    except Skip as e:
        return [], f"skipped {e}"
    except Exception as e:  # noqa: BLE001 - one odd module must not stop the build
        return [], f"skipped {name}: {type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.tasks.stdlib_bugs",
                                description="Inject bugs into stdlib modules so that their own tests fail.")
    p.add_argument("--out", required=True, help="output folder (tasks.jsonl, workspaces/, hidden/)")
    p.add_argument("--max", type=int, default=40, help="at most this many tasks (default 40)")
    p.add_argument("--modules", help="comma-separated module names, or 'all' (default: a curated set)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-module", type=int, default=3, help="tasks per module at most (default 3)")
    p.add_argument("--tries", type=int, default=3, help="mutations tried per function (default 3)")
    p.add_argument("--max-failing", type=int, default=10, help="discard bugs failing more tests (default 10)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per test run at most (default 60)")
    p.add_argument("--jobs", type=int, default=1, help="modules scanned at once (default 1)")
    p.add_argument("--split", default="", choices=["", "train", "heldout"])
    args = p.parse_args(argv)
    if args.modules == "all":
        modules = candidates()
    elif args.modules:
        modules = [m.strip() for m in args.modules.split(",") if m.strip()]
        bad = [m for m in modules if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", m)]
        if bad:
            p.error(f"not module names: {', '.join(bad)}")
    else:
        modules = None
    tasks = build(args.out, modules, args.max, args.seed, args.per_module, args.tries, args.max_failing,
                  args.timeout, args.jobs, args.split)
    return 0 if tasks else 1


if __name__ == "__main__":
    sys.exit(main())
