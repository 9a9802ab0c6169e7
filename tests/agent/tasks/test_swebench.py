"""The SWE-bench-style importer on a fixture in that format built from a local git repository: the
base commit fails verify, the fix passes it, a wrong fix fails, workspaces leave the repository alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.tasks.patches import patch_files, patch_lines
from agent.tasks.suites import load_tasks
from agent.tasks.swebench import Skipped, parse_test_ids, resolve_repo, verify_command
from agent.tasks.workspace import Workspace

ROOT = Path(__file__).resolve().parents[3]
BUGGY = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
FIXED = BUGGY.replace("return a - b\n\n\n", "return a + b\n\n\n")
TESTS = ("import pytest\n\nfrom calc import add, sub\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n\n\n"
         "@pytest.mark.parametrize('s', ['a b', 'x;$(touch PWNED)'])\ndef test_param(s):\n    assert s\n")
NEW_TEST = "\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """repos/owner__calc: a bug at the base commit, fixed by a later commit on main; SWE-bench rows."""
    with pytest.MonkeyPatch.context() as mp:  # verify's `python` is the one running these tests
        mp.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        mp.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the venv's plugins cost seconds per verify
        yield _make(tmp_path_factory.mktemp("swe"))


def _make(tmp_path: Path):
    repo = tmp_path / "repos" / "owner__calc"
    (repo / "tests").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "T")
    (repo / "calc.py").write_text(BUGGY)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    (repo / "conftest.py").write_text("")  # calc importable from tests/
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "calc with a bug")
    base = git(repo, "rev-parse", "HEAD")
    (repo / "tests" / "test_calc.py").write_text(TESTS + NEW_TEST)
    test_patch = subprocess.run(["git", "diff"], cwd=repo, check=True, capture_output=True, text=True).stdout
    git(repo, "checkout", "-q", "--", ".")
    (repo / "calc.py").write_text(FIXED)  # upstream fixed it later: a workspace at HEAD would pass
    gold = subprocess.run(["git", "diff"], cwd=repo, check=True, capture_output=True, text=True).stdout
    git(repo, "commit", "-q", "-am", "fix add")
    rows = [
        {"instance_id": "owner__calc-1", "repo": "owner/calc", "base_commit": base, "version": "1.0",
         "environment_setup_commit": base, "patch": gold, "problem_statement": "add(2, 3) gives -1, should be 5",
         "test_patch": test_patch, "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
         "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_sub", "tests/test_calc.py::test_param[a b]",
                                     "tests/test_calc.py::test_param[x;$(touch PWNED)]"])},
        {"instance_id": "nobody__gone-7", "repo": "nobody/gone", "base_commit": base, "problem_statement": "x",
         "test_patch": "", "FAIL_TO_PASS": "[\"t.py::test_x\"]", "PASS_TO_PASS": "[]"},
        {"instance_id": "owner__calc-2", "repo": "owner/calc", "base_commit": "0" * 40, "problem_statement": "x",
         "test_patch": "", "FAIL_TO_PASS": "[\"t.py::test_x\"]", "PASS_TO_PASS": "[]"},
        {"instance_id": "django__django-1", "repo": "owner/calc", "base_commit": base, "problem_statement": "x",
         "test_patch": "", "FAIL_TO_PASS": "[\"test_x (tests.T)\"]", "PASS_TO_PASS": "[]"},
    ]
    src = tmp_path / "swe.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    state = (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain"), git(repo, "for-each-ref"),
             git(repo, "worktree", "list"))
    p = subprocess.run([sys.executable, "-m", "agent.tasks.swebench", str(src), "--out",
                        str(tmp_path / "tasks.jsonl"), "--repos", str(tmp_path / "repos")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    return tmp_path, repo, base, state, p


def test_import_skips_what_is_not_here(fixture):
    tmp_path, repo, base, _, p = fixture
    assert p.returncode == 0, p.stderr
    assert "skipped nobody__gone-7: repository nobody/gone not found locally" in p.stderr
    assert "skipped owner__calc-2: base_commit" in p.stderr
    assert "skipped django__django-1: test ids are not pytest ids" in p.stderr
    (task,) = load_tasks(tmp_path / "tasks.jsonl")
    assert task.id == "owner__calc-1" and task.family == "swe"
    assert task.repo == str(repo.resolve()) and task.commit == base
    assert task.prompt == "add(2, 3) gives -1, should be 5"
    assert "test_add" in task.hidden_patch and "test_add" not in task.prompt
    assert task.meta["FAIL_TO_PASS"] == ["tests/test_calc.py::test_add"] and len(task.meta["PASS_TO_PASS"]) == 3
    # the gold patch is the reference fix the quality metrics compare with: calc.py, one line swapped
    assert patch_files(task.reference_patch) == ["calc.py"] and patch_lines(task.reference_patch) == 2


def test_verify_fails_at_base_and_passes_with_the_fix(fixture):
    tmp_path, repo, base, state, p = fixture
    assert p.returncode == 0, p.stderr
    (task,) = load_tasks(tmp_path / "tasks.jsonl")

    ws = Workspace.create(task)
    try:  # the unmodified checkout: at base (not HEAD), without the hidden test, and failing verify
        assert git(ws.root, "rev-parse", "HEAD") == base
        assert (ws.root / "calc.py").read_text() == BUGGY
        assert "test_add" not in (ws.root / "tests" / "test_calc.py").read_text()
        passed, out = ws.verify()
        assert not passed and "test_add" in out
    finally:
        ws.cleanup()

    ws = Workspace.create(task)
    try:  # the fix
        (ws.root / "calc.py").write_text(FIXED)
        passed, out = ws.verify()
        assert passed, out
        assert "4 passed" in out  # every listed test ran, the odd ids included
        assert not (ws.root / "PWNED").exists() and not (ROOT / "PWNED").exists()
    finally:
        ws.cleanup()

    for wrong in (BUGGY.replace("a - b\n\n\n", "a * b\n\n\n"),  # FAIL_TO_PASS still fails
                  FIXED.replace("return a - b", "return b - a")):  # breaks a PASS_TO_PASS test
        ws = Workspace.create(task)
        try:
            (ws.root / "calc.py").write_text(wrong)
            assert ws.verify()[0] is False
        finally:
            ws.cleanup()

    # an agent that edits the test file the patch touches cannot pass either
    ws = Workspace.create(task)
    try:
        (ws.root / "calc.py").write_text(FIXED)
        (ws.root / "tests" / "test_calc.py").write_text("def test_add():\n    pass\n")
        passed, out = ws.verify()
        assert not passed
    finally:
        ws.cleanup()

    # the source repository is untouched: same HEAD, clean tree, same refs, no worktrees
    assert (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain"), git(repo, "for-each-ref"),
            git(repo, "worktree", "list")) == state
    assert (repo / "calc.py").read_text() == FIXED


def test_workspaces_of_one_task_are_independent(fixture):
    tmp_path, repo, base, state, p = fixture
    assert p.returncode == 0, p.stderr
    (task,) = load_tasks(tmp_path / "tasks.jsonl")
    a, b = Workspace.create(task), Workspace.create(task)
    try:
        (a.root / "calc.py").write_text(FIXED)
        # an identity of its own: the machine's git may have none (a fresh HOME)
        git(a.root, "-c", "user.name=agent", "-c", "user.email=agent@localhost", "commit", "-qam", "agent commit",
            "--no-verify")
        assert a.verify()[0] is True
        assert (b.root / "calc.py").read_text() == BUGGY
        assert git(b.root, "rev-parse", "HEAD") == base
        assert b.verify()[0] is False
    finally:
        a.cleanup()
        b.cleanup()
    assert (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain"), git(repo, "for-each-ref"),
            git(repo, "worktree", "list")) == state


def test_ids_quoting_and_repo_layouts(tmp_path):
    assert parse_test_ids('["a.py::t", "b.py::u[x y]"]', "F") == ["a.py::t", "b.py::u[x y]"]
    assert parse_test_ids(["a.py::t"], "F") == ["a.py::t"] and parse_test_ids("", "P") == []
    with pytest.raises(Skipped):
        parse_test_ids("not json", "F")
    cmd = verify_command(["a.py::t[x'y]"], ["b.py::u; rm -rf /", "a.py::t[x'y]"])
    assert cmd.count("a.py::t") == 1
    assert subprocess.run(["bash", "-c", f"printf '%s\\n' {cmd.split(' -- ', 1)[1]}"], capture_output=True,
                          text=True).stdout.splitlines() == ["a.py::t[x'y]", "b.py::u; rm -rf /"]
    for layout in ("owner__name", "name"):
        d = tmp_path / layout / layout
        d.mkdir(parents=True)
        git(d, "init", "-q")
        assert resolve_repo("owner/name", tmp_path / layout) == d.resolve()
    with pytest.raises(Skipped, match="not found locally"):
        resolve_repo("owner/name", tmp_path)
