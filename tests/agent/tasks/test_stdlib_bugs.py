"""Bug injection into the standard library, checked with real files and real test runs: the recorded
tests (and only they) fail in a fresh workspace, the unmutated copy and the restored function pass,
editing the visible test does not fool verify, nothing leaks into the source or between workspaces."""

from __future__ import annotations

import ast
import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from agent.tasks.patches import patch_files, patch_lines
from agent.tasks.stdlib_bugs import (
    FAMILY,
    Skip,
    Target,
    build,
    copy_module,
    module_source,
    mutants,
    run_tests,
    scan_module,
    splice,
    targets,
)
from agent.tasks.suites import load_tasks
from agent.tasks.workspace import Workspace

ROOT = Path(__file__).resolve().parents[3]
MODULES = ["colorsys", "textwrap"]


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    stdlib_before = {m: hashlib.sha256(module_source(m).read_bytes()).hexdigest() for m in MODULES}
    out = tmp_path_factory.mktemp("stdlib-bugs")
    logs: list[str] = []
    tasks = build(out, MODULES, max_tasks=4, seed=3, per_module=2, log=logs.append)
    assert {m: hashlib.sha256(module_source(m).read_bytes()).hexdigest() for m in MODULES} == stdlib_before
    return out, load_tasks(out / "tasks.jsonl"), tasks, logs


def test_tasks_are_recorded_with_relative_paths(built):
    out, tasks, _, logs = built
    assert len(tasks) == 4 and {t.meta["module"] for t in tasks} == set(MODULES)
    assert any("colorsys" in line and "tasks from" in line for line in logs)
    for line in (out / "tasks.jsonl").read_text().splitlines():
        raw = json.loads(line)
        assert raw["workspace"] == f"workspaces/{raw['id']}" and raw["hidden"] == f"hidden/{raw['id']}"
    for t in tasks:
        m = t.meta
        assert t.family == FAMILY and t.tag == m["mutation"]
        assert m["failing_tests"] and all(i.startswith(f"test_{m['module']}.") for i in m["failing_tests"])
        assert sorted(p.name for p in Path(t.workspace).iterdir()) == sorted([m["file"], f"test_{m['module']}.py"])
        assert [p.name for p in Path(t.hidden).iterdir()] == [f"test_{m['module']}.py"]
        # the prompt names the test module and a failing test, not the mutated function's definition
        assert f"test_{m['module']}" in t.prompt
        assert any(i.rsplit(".", 1)[1] in t.prompt for i in m["failing_tests"])
        assert f"def {m['function'].split('.')[-1]}" not in t.prompt
        assert f"test_{m['module']}" in t.verify
        # the stdlib's copy and the workspace's differ only inside the recorded function, from the recorded line
        src = module_source(m["module"]).read_text().splitlines()
        bad = (Path(t.workspace) / m["file"]).read_text().splitlines()
        target = next(x for x in targets("\n".join(bad), m["file"]) if x.qualname == m["function"])
        tail = len(bad) - target.end_lineno
        assert bad[: m["line"] - 1] == src[: m["line"] - 1] and bad[m["line"] - 1] != src[m["line"] - 1]
        assert target.lineno <= m["line"] <= target.end_lineno
        assert bad[len(bad) - tail:] == src[len(src) - tail:]


def test_generation_is_deterministic_for_a_seed(built, tmp_path):
    out, _, _, _ = built
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "agent.tasks.stdlib_bugs", "--out", str(tmp_path / "again"),
                        "--max", "4", "--seed", "3", "--per-module", "2", "--modules", ",".join(MODULES)],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "4 tasks from 2 modules" in p.stderr
    assert (tmp_path / "again" / "tasks.jsonl").read_text() == (out / "tasks.jsonl").read_text()
    assert _tree_digest(tmp_path / "again") == _tree_digest(out)
    other = build(tmp_path / "seed4", MODULES, max_tasks=4, seed=4, per_module=2, log=lambda s: None)
    assert [t.meta for t in other] != [json.loads(x)["meta"] for x in (out / "tasks.jsonl").read_text().splitlines()]


def test_injected_bug_fails_exactly_the_recorded_tests(built):
    _, tasks, _, _ = built
    for t in tasks:
        ws = Workspace.create(t)
        try:
            res = run_tests(ws.root, t.meta["module"])
            assert not res.ok and res.shadowed
            assert res.failing == t.meta["failing_tests"]
            assert res.tests_run == t.meta["tests"]
            passed, output = ws.verify()
            assert not passed
            assert "FAILED (" in output
        finally:
            ws.cleanup()


def test_unmutated_copy_passes(tmp_path):
    for m in MODULES:
        files = copy_module(m, tmp_path / m)
        res = run_tests(tmp_path / m, m, profile_files=files)
        assert res.ok and res.shadowed and res.tests_run > 0 and not res.failing
        assert res.called  # the profiler saw the workspace copy's functions run


def test_verify_passes_after_restoring_the_original_function(built):
    _, tasks, _, _ = built
    for t in tasks:
        m = t.meta
        good = module_source(m["module"]).read_text()
        ws = Workspace.create(t)
        try:
            path = ws.root / m["file"]
            bad = path.read_text()
            tg = next(x for x in targets(good, m["file"]) if x.qualname == m["function"])
            tb = next(x for x in targets(bad, m["file"]) if x.qualname == m["function"])
            g, b = good.splitlines(keepends=True), bad.splitlines(keepends=True)
            path.write_text("".join(b[: tb.lineno - 1] + g[tg.lineno - 1: tg.end_lineno] + b[tb.end_lineno:]))
            assert path.read_text() == good
            passed, output = ws.verify()
            assert passed, output
        finally:
            ws.cleanup()
        ws = Workspace.create(t)  # the task's reference_patch is that same fix, as `git apply` takes it
        try:
            subprocess.run(["git", "apply", "-"], input=t.reference_patch, text=True, cwd=ws.root, check=True)
            assert (ws.root / m["file"]).read_text() == good
            assert patch_files(t.reference_patch) == [m["file"]] and 2 <= patch_lines(t.reference_patch) <= 8
        finally:
            ws.cleanup()


def test_editing_the_visible_test_does_not_fool_verify(built):
    _, tasks, _, _ = built
    t = tasks[0]
    mod = t.meta["module"]
    ws = Workspace.create(t)
    try:
        (ws.root / f"test_{mod}.py").write_text("import unittest\n\nclass T(unittest.TestCase):\n"
                                                "    def test_ok(self):\n        pass\n")
        fooled = run_tests(ws.root, mod)
        assert fooled.ok  # the edited test alone would pass ...
        passed, _ = ws.verify()
        assert not passed  # ... but verify runs the pristine copy
        assert (ws.root / f"test_{mod}.py").read_text() == (Path(t.hidden) / f"test_{mod}.py").read_text()
    finally:
        ws.cleanup()
    ws = Workspace.create(t)
    try:  # deleting the broken module lets the stdlib's copy pass the tests, but not verify
        (ws.root / t.meta["file"]).unlink()
        assert run_tests(ws.root, mod).ok
        passed, output = ws.verify()
        assert not passed and f"{mod} is not the copy in this folder" in output
    finally:
        ws.cleanup()


def test_workspaces_do_not_leak(built):
    out, tasks, _, _ = built
    before = _tree_digest(out)
    t = tasks[0]
    a, b = Workspace.create(t), Workspace.create(t)
    try:
        assert a.root != b.root
        (a.root / t.meta["file"]).write_text("BROKEN = True\n")
        (a.root / "new_file.txt").write_text("x")
        assert a.verify()[0] is False
        assert not (b.root / "new_file.txt").exists()
        assert (b.root / t.meta["file"]).read_text() == (Path(t.workspace) / t.meta["file"]).read_text()
        assert b.verify()[0] is False  # b still holds the bug, and its own copy
    finally:
        a.cleanup()
        b.cleanup()
    assert not a.root.parent.exists() and not b.root.parent.exists()
    assert _tree_digest(out) == before
    assert not list(out.rglob("__pycache__"))


def test_a_module_imported_at_start_up_is_skipped():
    with pytest.raises(Skip, match="shadow"):
        scan_module("genericpath", 0, 1, 1, 10, 60.0)


def test_splice_changes_only_the_mutated_node():
    text = ("import math\n\n\nclass Shape:\n    def area(self, a, b, c):\n        # the area, roughly\n"
            "        x = c - a * b  # keep this comment\n        return max(a, b) + x\n\n\n"
            "def other(n):\n    return n - 1\n")
    (target,) = [t for t in targets(text, "m.py") if t.qualname == "Shape.area"]
    seen = set()
    for kind, out in mutants(text, target, random.Random(0)):
        seen.add(kind)
        assert "# the area, roughly" in out and "# keep this comment" in out
        assert out.splitlines()[:4] == text.splitlines()[:4] and out.endswith("    return n - 1\n")
        diff = [(a, b) for a, b in zip(text.splitlines(), out.splitlines(), strict=True) if a != b]
        assert len(diff) == 1
        ast.parse(out)
    assert {"operator", "swap_args", "wrong_variable"} <= seen
    # an operator change inside a tighter expression gets parentheses (c - (a + b), not c - a + b)
    bad = "def area(self, a, b, c):\n    x = c - (a + b)\n    return max(a, b) + x\n"
    assert "x = c - (a + b)  # keep this comment" in splice(text, target, bad)
    assert splice(text, Target("m.py", "Shape.area", 5, 8), "def area(self, a, b, c):\n    return 0\n") is None
