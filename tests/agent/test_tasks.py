"""Tasks: the spec, isolated workspaces, the synthetic families' verifiers, the expert and the eval report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent.tasks import Task, TaskError, Workspace, load_tasks
from agent.tasks.eval import pass_at_k
from agent.tasks.families import FAMILIES, RENAMED_BASE, SIZES, build, expert_plan, generate
from agent.tasks.quality import figures
from agent.tasks.suites import HELDOUT_BASE, builtin


def apply_plan(task: Task, ws: Workspace) -> str:
    """Carry out the expert's plan directly (no model): its edits and commands; returns its answer."""
    answer = ""
    for turn in expert_plan(task):
        answer = turn.get("content", answer)
        for c in turn.get("tool_calls", []):
            a = c["arguments"]
            if c["name"] == "shell" and "pytest" not in a["command"]:  # test runs change nothing
                subprocess.run(["bash", "-c", a["command"]], cwd=ws.root, capture_output=True, check=False)
            elif c["name"] == "edit_file":
                p = ws.root / a["path"]
                text = p.read_text()
                assert text.count(a["old_string"]) == 1, (task.id, a["old_string"])
                p.write_text(text.replace(a["old_string"], a["new_string"]))
    return answer


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", list(SIZES))
def test_verifiers_fail_untouched_pass_the_expert_and_fail_a_wrong_edit(family, size):
    for seed in (0, RENAMED_BASE + 1, HELDOUT_BASE):
        task = generate(family, seed, size)
        ws = Workspace.create(task)
        try:
            assert not (ws.root / "_hidden").exists()  # the verifier is not there while the agent works
            ok, out = ws.verify("I looked around.")
            assert not ok, f"{task.id}: the untouched workspace passes its verifier:\n{out}"
        finally:
            ws.cleanup()
        ws = Workspace.create(task)
        try:
            ok, out = ws.verify(apply_plan(task, ws))
            assert ok, f"{task.id}: the expert's solution fails:\n{out}"
        finally:
            ws.cleanup()
        ws = Workspace.create(task)
        try:
            apply_plan(task, ws)
            module = next(iter(sorted((ws.root / "pkg").glob("[!_r]*.py"))))
            module.write_text(module.read_text().replace("return ", "return None and ", 1))  # a wrong edit
            ok, _ = ws.verify("wrong")
            assert not ok or family == "find-def", task.id  # find-def is judged on the answer only
        finally:
            ws.cleanup()


def test_generation_is_deterministic_and_splits_do_not_overlap():
    a, b = generate("bugfix", 3, "medium"), generate("bugfix", 3, "medium")
    assert a == b and a.prompt and a.meta["mutation"]
    train = {t.id for t in builtin("synthetic", 3)}
    heldout = builtin("synthetic-heldout", 3)
    assert all(t.split == "heldout" for t in heldout) and not train & {t.id for t in heldout}


def test_heldout_tasks_share_no_module_or_function_with_training():
    def names(tasks):
        out = set()
        for t in tasks:
            out |= {t.meta["function"], t.meta.get("module", t.meta["function"])}
        return out

    train = [generate(f, base + s, size) for f in FAMILIES for size in SIZES for s in range(40)
             for base in (0, RENAMED_BASE)]
    heldout = [generate(f, HELDOUT_BASE + s, size) for f in FAMILIES for size in SIZES for s in range(40)]
    assert not names(train) & names(heldout)
    # and not hidden inside the repositories either: no held-out file or function name in a training repo
    train_text = "".join(text for t in train for text in build(t.generator, t.seed, t.size).files.values())
    for t in heldout:
        assert t.meta["function"] + "(" not in train_text, t.id
        assert t.meta.get("module", "pkg/report.py") == "pkg/report.py" or t.meta["module"] not in train_text, t.id


def test_renamed_seeds_give_fresh_names_for_the_same_code():
    a, b = build("find-def", RENAMED_BASE + 5, "medium"), build("find-def", RENAMED_BASE + 6, "medium")
    plain = build("find-def", 5, "medium")
    assert a.meta["function"] != b.meta["function"] and a.meta["module"] != b.meta["module"]
    assert a.meta["function"] not in plain.files["pkg/report.py"]
    # the same repository layout, and the names are a function of the seed (the verifier test runs a renamed seed)
    assert len(a.files) == len(plain.files) and a.meta == build("find-def", RENAMED_BASE + 5, "medium").meta


def test_workspaces_are_isolated_and_cleaned(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("original\n")
    task = Task("iso", "p", "grep -q changed a.txt", workspace=str(src))
    one, two = Workspace.create(task), Workspace.create(task)
    (one.root / "a.txt").write_text("changed\n")
    assert (two.root / "a.txt").read_text() == "original\n" and (src / "a.txt").read_text() == "original\n"
    assert one.verify()[0] and not two.verify()[0]
    one.cleanup()
    two.cleanup()
    assert not one.root.exists() and not two.root.exists()


def test_git_source_is_checked_out_at_the_commit_without_touching_the_repo(git_repo):
    (git_repo / "f.txt").write_text("v1\n")
    subprocess.run(["git", "add", "."], cwd=git_repo, check=True)
    subprocess.run(["git", "commit", "-qm", "v1"], cwd=git_repo, check=True)
    first = subprocess.run(["git", "rev-parse", "HEAD"], cwd=git_repo, capture_output=True, text=True).stdout.strip()
    (git_repo / "f.txt").write_text("v2\n")
    subprocess.run(["git", "commit", "-qam", "v2"], cwd=git_repo, check=True)
    ws = Workspace.create(Task("g", "p", "grep -q v1 f.txt", repo=str(git_repo), commit=first))
    try:
        assert (ws.root / "f.txt").read_text() == "v1\n" and ws.verify()[0]
        (ws.root / "f.txt").write_text("mine\n")
        assert (git_repo / "f.txt").read_text() == "v2\n"
    finally:
        ws.cleanup()


def test_task_files_are_checked(tmp_path):
    (tmp_path / "ws").mkdir()
    good = {"id": "a", "prompt": "p", "verify": "true", "workspace": "ws"}
    cases = [({**good, "colour": 1}, "unknown fields"), ({**good, "generator": "bugfix"}, "exactly one"),
             ({**good, "workspace": "nope"}, "not a folder"), ({"id": "b", "prompt": "p", "verify": "true",
                                                              "generator": "nope"}, "unknown generator")]
    for row, message in cases:
        (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
        with pytest.raises(TaskError, match=message):
            load_tasks(tmp_path / "t.jsonl")
    (tmp_path / "t.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(TaskError, match="duplicate"):
        load_tasks(tmp_path / "t.jsonl")


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0 and pass_at_k(4, 4, 2) == 1
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)


def test_eval_with_the_expert_reports_what_the_trajectories_show(tmp_path):
    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "-m", "agent.cli", "eval", "synthetic-small", "--expert", "--limit", "4",
                        "--concurrency", "2", "--out", str(out), "--no-sandbox"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["overall"]["pass@1"] == 1.0 and report["overall"]["episodes"] == 4
    assert "| bugfix |" in r.stdout and (out / "report.png").exists()
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    calls = 0
    for row in rows:
        for line in open(row["session_path"]):
            rec = json.loads(line)
            calls += len(rec.get("calls", [])) if rec["type"] == "tools" else 0
    assert report["overall"]["tool_calls"] == pytest.approx(calls / len(rows), abs=1e-3)
    # the expert is clean on every quality metric (each metric's failing case: tests/agent/tasks/test_quality.py)
    assert "quality per episode" in r.stdout
    for row in rows:
        f = figures(row["quality"])
        assert f["test_edit"] == 0 and f["unneeded_files"] == 0 and f["size_ratio"] == 1.0, row
        assert f["new_lint"] == 0 and f["format_issues"] == 0 and f["unsupported_claims"] in (0, None), row
    # --resume finds everything done and runs nothing new
    r2 = subprocess.run([sys.executable, "-m", "agent.cli", "eval", "synthetic-small", "--expert", "--limit", "4",
                         "--out", str(out), "--resume", "--no-sandbox"], cwd=tmp_path, capture_output=True, text=True,
                        timeout=300)
    assert r2.returncode == 0 and len((out / "results.jsonl").read_text().splitlines()) == 4


def test_the_expert_tells_apart_tasks_that_share_a_prompt(tmp_path):
    """bugfix seeds 7 and 8 ask the same question of different repositories: keyed by prompt alone, the
    expert replayed one task's fix in the other's workspace (wrong SFT data, a failed expert episode)."""
    from agent.tasks.spec import write_tasks

    a, b = generate("bugfix", 7, "small"), generate("bugfix", 8, "small")
    assert a.prompt == b.prompt and expert_plan(a) != expert_plan(b)
    tasks = write_tasks([a, b], tmp_path / "tasks.jsonl")
    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "-m", "agent.cli", "eval", str(tasks), "--expert", "--concurrency", "2",
                        "--out", str(out), "--no-sandbox"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["overall"]["episodes"] == 2 and report["overall"]["pass@1"] == 1.0, r.stdout
