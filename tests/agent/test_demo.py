"""`composer-agent demo`: the repository it writes fails until the bug is fixed, green needs the real
fix (not an edited test), and the whole command runs end to end against a scripted model on loopback
(the expert's solution) and, once it ships, the trained built-in model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from agent import demo
from agent.scripted import ScriptedServer
from agent.tasks.families import build
from tests.agent.test_builtin_model import TAG, tagged_gone

BIN = Path(sys.executable).parent
SHIPPED = Path(__file__).parents[2] / "serve" / "builtin" / "composer-tiny"


def expert_script(family: str) -> list[dict]:
    return [dict(turn) for turn in build(family, demo.DEMOS[family], demo.SIZE).plan]


def fix(root: Path) -> None:
    """Apply the expert's edit (the one correct fix) to the bugfix demo."""
    call = next(
        c for t in expert_script("bugfix") for c in t.get("tool_calls", []) if c["name"] == "edit_file"
    )
    path = root / call["arguments"]["path"]
    text = path.read_text()
    assert call["arguments"]["old_string"] in text
    path.write_text(text.replace(call["arguments"]["old_string"], call["arguments"]["new_string"], 1))


def run_demo(tmp_path: Path, *args: str, timeout: float = 180, tag: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), TAG: tag}
    env.pop("COMPOSER_BASE_URL", None)
    return subprocess.run(
        [str(BIN / "composer-agent"), "demo", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.slow
def test_the_bugfix_demo_fails_until_the_bug_is_fixed(tmp_path):
    root = tmp_path / "repo"
    task = demo.demo_task("bugfix")
    demo.write_repo(root, task)
    assert demo.run_tests(root)[0] is False and demo.green(root, task, "")[0] is False
    fix(root)
    ok, line = demo.run_tests(root)
    assert ok and "passed" in line
    assert demo.green(root, task, "") == (True, "")
    assert not (root / "_hidden").exists()  # the checker ran on a copy


def test_editing_the_test_instead_of_the_code_is_not_green(tmp_path):
    root = tmp_path / "repo"
    task = demo.demo_task("bugfix")
    demo.write_repo(root, task)
    for test in (root / "tests").glob("test_*.py"):
        test.write_text("def test_nothing():\n    assert True\n")
    assert demo.run_tests(root)[0] is True
    ok, why = demo.green(root, task, "")
    assert ok is False and "expected" in why


def test_a_closing_sentence_that_names_another_function_than_the_diff_is_caught(tmp_path):
    """The built-in model's summary named `compound` under a diff of cents() in 8 of 9 runs; the demo can
    check that much of a claim against git diff, and does."""
    root = tmp_path / "repo"
    demo.write_repo(root, demo.demo_task("bugfix"))
    fix(root)
    hunks = demo.changes(root)
    assert [h.function for h in hunks] == ["cents"]
    wrong = "Fixed `compound` in pkg/money.py: the wrong variable is corrected and the tests pass."
    assert demo.misnamed(wrong, root, hunks) == ["compound"]
    assert demo.misnamed("Fixed `cents()` in pkg/money.py: the constant is corrected.", root, hunks) == []
    assert demo.misnamed("Fixed `cents`; `compound` was fine.", root, hunks) == []
    assert demo.misnamed("Fixed the rounding in `pkg` and `tests`.", root, hunks) == []  # not functions


def test_the_find_def_demo_is_green_only_with_the_right_file(tmp_path):
    root = tmp_path / "repo"
    task = demo.demo_task("find-def")
    assert 50_000 <= task.seed < 1_000_000  # a new seed of the training code (trained on seeds 0..599)
    demo.write_repo(root, task)
    right = expert_script("find-def")[-1]["content"]
    assert demo.green(root, task, right) == (True, "")
    wrong = right.replace(task.meta["module"], "pkg/report.py")
    assert demo.green(root, task, wrong)[0] is False


@pytest.mark.slow
def test_the_bugfix_demo_with_the_experts_answers_goes_green_showing_parallel_calls(tmp_path):
    with ScriptedServer(expert_script("bugfix")) as srv:
        p = run_demo(tmp_path, "--dir", str(tmp_path / "d"), "--base-url", srv.base_url)
        first = srv.chat_requests()[0]
    assert p.returncode == 0, p.stderr
    err = p.stderr
    assert "wrote a small repository" in err and "1 failed" in err.split("asking")[0]
    assert "2 tool calls in one turn, run in parallel" in err
    for name in ("shell", "read_file", "edit_file"):
        assert f"→ {name} " in err
    assert "demo: green" in err and "passed" in err.split("its tests now:")[1]
    # the summary comes from the repository: the file, function and lines the fix changed, before the
    # model's own words (which the expert's script could make say anything)
    call = next(c for t in expert_script("bugfix") for c in t.get("tool_calls", []) if c["name"] == "edit_file")
    old, new = call["arguments"]["old_string"].strip(), call["arguments"]["new_string"].strip()
    changed = err.split("what changed (git diff): ")[1].splitlines()[0]
    assert changed.startswith(call["arguments"]["path"]) and new.splitlines()[0].strip() in changed
    function = old.split("def ")[1].split("(")[0] if "def " in old else None
    assert function is None or f"in {function}()" in changed
    assert err.index("what changed") < err.index("the model says")
    edit_line = next(x for x in err.splitlines() if "✓ edit_file" in x)
    assert new.splitlines()[0].strip()[:50] in edit_line  # the changed line, not the file's last one
    read_line = next(x for x in err.splitlines() if "✓ read_file" in x)
    assert read_line.endswith(f"): {call['arguments']['path']} · lines 1–16 of 16")  # what was read, not its last line
    assert "note:" not in err  # the expert's summary names the function it changed
    assert first["temperature"] == 0.0  # greedy
    assert "small built-in model" not in err  # --base-url: no child server
    diff = subprocess.run(
        ["git", "diff", "--stat"], cwd=tmp_path / "d", capture_output=True, text=True
    ).stdout
    assert "pkg/" in diff  # the fix is there to look at


@pytest.mark.slow
def test_the_demo_points_out_a_summary_that_contradicts_the_diff(tmp_path):
    script = expert_script("bugfix")
    script[-1] = {"content": "Fixed `compound` in pkg/money.py: the wrong variable is corrected and the tests pass."}
    with ScriptedServer(script) as srv:
        p = run_demo(tmp_path, "--dir", str(tmp_path / "d"), "--base-url", srv.base_url)
    assert p.returncode == 0, p.stderr  # still green: the fix is right, only the sentence is wrong
    said = p.stderr.split("the model says")[1]
    assert "note: that names compound(), but the diff above changed cents()" in said, p.stderr


@pytest.mark.slow
def test_the_find_def_demo_with_the_experts_answers_goes_green(tmp_path):
    with ScriptedServer(expert_script("find-def")) as srv:
        p = run_demo(
            tmp_path, "--dir", str(tmp_path / "d"), "--base-url", srv.base_url, "--family", "find-def"
        )
    assert p.returncode == 0, p.stderr
    assert "→ grep " in p.stderr and "demo: green" in p.stderr


@pytest.mark.slow
def test_the_demo_says_not_green_and_exits_1_when_the_model_does_not_fix_it(tmp_path):
    with ScriptedServer([{"content": "I could not find the bug."}]) as srv:
        p = run_demo(tmp_path, "--dir", str(tmp_path / "d"), "--base-url", srv.base_url)
    assert p.returncode == 1, p.stderr
    assert "not green" in p.stderr and "expected" in p.stderr


def test_the_demo_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep.txt").write_text("mine")
    p = run_demo(tmp_path, "--dir", str(tmp_path / "d"), "--base-url", "http://127.0.0.1:9/v1")
    assert p.returncode == 2 and "not empty" in p.stderr
    assert sorted(x.name for x in (tmp_path / "d").iterdir()) == ["keep.txt"]


# -- the shipped model --------------------------------------------------------------------------------

needs_shipped = pytest.mark.skipif(
    not (SHIPPED / "config.json").is_file(),
    reason="the trained composer-tiny checkpoint is not in serve/builtin yet",
)


@needs_shipped
@pytest.mark.slow
def test_the_builtin_model_solves_the_demo_task_with_no_endpoint(tmp_path, monkeypatch):
    tag = f"demo-{uuid.uuid4().hex}"
    monkeypatch.setenv("PYTEST_ADDOPTS", "--durations=5")  # a user's own pytest options must not change the demo
    p = run_demo(tmp_path, "--dir", str(tmp_path / "d"), timeout=600, tag=tag)
    assert p.returncode == 0, p.stderr
    assert "small built-in model" in p.stderr and "demo: green" in p.stderr and "cannot rename" in p.stderr
    assert "2 tool calls in one turn, run in parallel" in p.stderr  # test and code read together
    for name in ("shell", "read_file", "edit_file"):
        assert f"→ {name} " in p.stderr
    assert "passed" in p.stderr.split("its tests now:")[1]
    assert "its claim, unverified" in p.stderr
    assert tagged_gone(tag, 1), "the demo's own child server outlived it"


@needs_shipped
@pytest.mark.slow
def test_composer_agent_task_with_no_endpoint_solves_the_demo_task_greedily(tmp_path):
    root = tmp_path / "repo"
    task = demo.demo_task(demo.BUILTIN_FAMILY)
    demo.write_repo(root, task)
    tag = f"task-{uuid.uuid4().hex}"
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), TAG: tag}
    for var in ("COMPOSER_BASE_URL", "COMPOSER_BUILTIN_MODEL"):
        env.pop(var, None)
    p = subprocess.run(
        [str(BIN / "composer-agent"), "--cwd", str(root), "--task", task.prompt, "--json", "--approval", "auto"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    events = [json.loads(line) for line in p.stdout.splitlines()]
    assert p.returncode == 0 and events[-1]["status"] == "completed", p.stderr
    assert events[-1]["model_builtin"] is True and events[0]["model_builtin"] is True
    assert demo.green(root, task, events[-1]["final_text"]) == (True, "")
    # our own child, found by a variable only its environment holds: another composer-serve of the same
    # built-in model on this machine (another user's, another test's) must not fail this
    assert tagged_gone(tag, 1), "the child server outlived composer-agent"
