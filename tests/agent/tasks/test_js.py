"""JavaScript tasks with node's own test runner: the js-bugfix builder (untouched repo fails, the
reference fix passes, an edited test does not fool verify, the expert solves the suite cleanly through
the real harness), node's syntax check as the lint metric, and SWE-style rows of a JavaScript repository."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.tasks import Workspace
from agent.tasks.families import build, generate
from agent.tasks.quality import Baseline, figures, measure
from agent.tasks.suites import builtin, load_tasks
from agent.tasks.swebench import import_rows

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs node")


def apply(patch: str, root: Path) -> None:
    subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=root, check=True)


@pytest.mark.parametrize("seed,size", [(0, "small"), (1, "medium"), (5, "large")])
def test_untouched_fails_reference_passes_edited_test_fails(seed, size):
    task = generate("js-bugfix", seed, size)
    assert task.verify.startswith("node --test") and task.meta["language"] == "javascript"
    for fix in (None, "reference", "gut the test"):
        ws = Workspace.create(task)
        try:
            test = ws.root / task.meta["module"].replace("src/", "test/").replace(".js", ".test.js")
            if fix == "reference":
                apply(task.reference_patch, ws.root)
            elif fix == "gut the test":
                test.write_text("require('node:test')('ok', () => {});\n")
            passed, out = ws.verify()
            assert passed == (fix == "reference"), (fix, out)
        finally:
            ws.cleanup()


def test_builds_are_deterministic_and_vary_with_the_seed():
    a, b = build("js-bugfix", 3, "medium"), build("js-bugfix", 3, "medium")
    assert a.files == b.files and a.plan == b.plan
    funcs = {generate("js-bugfix", s, "small").meta["function"] for s in range(10)}
    assert len(funcs) >= 3


def test_syntax_errors_are_new_lint(tmp_path):
    task = generate("js-bugfix", 0, "small")
    path = task.meta["module"]
    ws = Workspace.create(task)
    try:
        base = Baseline.take(ws.root, ws.home)
        apply(task.reference_patch, ws.root)
        assert measure(task, base)["new_lint"] == []
        p = ws.root / path
        p.write_text(p.read_text().replace("return", "retrun", 1))
        q = measure(task, base)
        assert len(q["new_lint"]) == 1 and q["new_lint"][0].startswith(f"{path}:") and "SyntaxError" in q["new_lint"][0]
    finally:
        ws.cleanup()


def test_the_expert_solves_js_small_cleanly(tmp_path):
    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "-m", "agent.cli", "eval", "js-small", "--expert", "--concurrency", "2",
                        "--out", str(out), "--no-sandbox"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["overall"]["episodes"] == len(builtin("js-small")) == 10 and report["overall"]["pass@1"] == 1.0
    for line in (out / "results.jsonl").read_text().splitlines():
        f = figures(json.loads(line)["quality"])
        assert f["test_edit"] == 0 and f["unneeded_files"] == 0 and f["size_ratio"] == 1.0 and f["new_lint"] == 0
        assert f["unsupported_claims"] == 0 and f["format_issues"] is None  # no JavaScript formatter installed


CALC = "'use strict';\n\nfunction add(a, b) {\n  return a - b;\n}\n\nmodule.exports = { add };\n"
TEST = ("'use strict';\n\nconst test = require('node:test');\nconst assert = require('node:assert/strict');\n"
        "const { add } = require('../src/calc.js');\n\ntest('keeps zero', () => {\n  assert.equal(add(0, 0), 0);\n});\n")
NEW = "\ntest('adds', () => {\n  assert.equal(add(2, 3), 5);\n});\n"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_swe_rows_of_a_javascript_repository(tmp_path):
    repo = tmp_path / "repos" / "owner__calcjs"
    (repo / "src").mkdir(parents=True)
    (repo / "test").mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "src" / "calc.js").write_text(CALC)
    (repo / "test" / "calc.test.js").write_text(TEST)
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@x", "commit", "-qm", "bug")
    base = git(repo, "rev-parse", "HEAD")
    (repo / "test" / "calc.test.js").write_text(TEST + NEW)
    test_patch = git(repo, "diff") + "\n"
    git(repo, "checkout", "-q", "--", ".")
    (repo / "src" / "calc.js").write_text(CALC.replace("a - b", "a + b"))
    gold = git(repo, "diff") + "\n"
    git(repo, "checkout", "-q", "--", ".")
    row = {"instance_id": "owner__calcjs-1", "repo": "owner/calcjs", "base_commit": base, "language": "javascript",
           "problem_statement": "add(2, 3) is -1", "test_patch": test_patch, "patch": gold,
           "FAIL_TO_PASS": json.dumps(["test/calc.test.js::adds"]),
           "PASS_TO_PASS": json.dumps(["test/calc.test.js::keeps zero"])}
    ts = [{**row, "instance_id": "ts-1", "language": "typescript"}]
    logs: list[str] = []
    tasks = import_rows([row, *ts], tmp_path / "repos", log=logs.append)
    assert [t.id for t in tasks] == ["owner__calcjs-1"] and "skipped ts-1: TypeScript" in logs[0]
    task = tasks[0]
    assert task.verify == "node --test --test-name-pattern='^(adds|keeps\\ zero)$' test/calc.test.js"
    assert task.reference_patch == gold and task.meta["language"] == "javascript"
    from agent.tasks.spec import write_tasks

    (task,) = load_tasks(write_tasks([task], tmp_path / "tasks.jsonl"))
    for fixed in (False, True):
        ws = Workspace.create(task)
        try:
            if fixed:
                apply(task.reference_patch, ws.root)
            passed, out = ws.verify()
            assert passed == fixed, out
            assert ("# pass 2" in out) == fixed  # both listed tests ran, from the hidden test patch
        finally:
            ws.cleanup()
