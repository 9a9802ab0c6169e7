"""Varied environments for training episodes: real folders of other shapes, real git repositories, dates."""

from __future__ import annotations

import datetime
import json
import subprocess
import time

from agent.config import Config
from agent.context import system_prompt
from agent.tasks import Workspace
from agent.tasks.eval import EvalConfig, run_eval
from agent.tasks.expert import ExpertServer
from agent.tasks.families import generate
from agent.tasks.variation import FIRST_DAY, draw


def test_draws_are_reproducible_and_spread():
    assert draw("bugfix-small-3/0") == draw("bugfix-small-3/0") != draw("bugfix-small-3/1")
    vs = [draw(f"find-def-small-{i}/0") for i in range(300)]
    dates = {datetime.date.fromisoformat(v.date) for v in vs}
    assert len(dates) > 250 and min(dates) >= FIRST_DAY and max(dates) > FIRST_DAY + datetime.timedelta(days=5 * 365)
    assert len({v.name for v in vs}) >= 15 and len({v.dirs for v in vs}) > 100
    in_git = sum(v.branch is not None for v in vs)
    assert 100 < in_git < 200 and len({v.branch for v in vs}) >= 8


def test_only_the_date_line_changes(tmp_path):
    system = system_prompt(tmp_path)
    assert f"- Date: {time.strftime('%Y-%m-%d')}" in system
    changed = system_prompt(tmp_path, date="2029-02-28")
    assert "- Date: 2029-02-28" in changed and time.strftime("%Y-%m-%d") not in changed
    assert [a for a, b in zip(system.splitlines(), changed.splitlines(), strict=True) if a != b] == [
        f"- Date: {time.strftime('%Y-%m-%d')}"]


def test_a_varied_workspace_is_a_real_repository_at_the_drawn_path(tmp_path):
    task = generate("bugfix", 5, "small")
    v = next(draw(f"k{i}") for i in range(100) if draw(f"k{i}").branch and len(draw(f"k{i}").dirs) >= 2)
    ws = Workspace.create(task, parent=tmp_path, variation=v)
    assert ws.root.parts[-len(v.dirs) - 1:] == (*v.dirs, v.name) and ws.home.parent == tmp_path
    assert ws.home.name.startswith(v.prefix)
    head = subprocess.run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=ws.root, capture_output=True, text=True)
    assert head.stdout.strip() == v.branch
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ws.root, capture_output=True, text=True)
    assert dirty.returncode == 0 and dirty.stdout == ""
    assert (ws.root / "tests").is_dir()
    assert ws.verify()[0] is False  # the injected bug is still there
    ws.cleanup()
    assert not ws.home.exists() and list(tmp_path.iterdir()) == []


def test_the_expert_recorded_with_variation_sees_each_drawn_environment(tmp_path):
    """Through the real loop: each episode's system prompt names its variation's folder, date and git
    state, and the expert still solves every task there."""
    tasks = [generate("bugfix", s, "small") for s in range(3)] + [generate("find-def", 0, "small")]
    with ExpertServer(tasks) as srv:
        report = run_eval(tasks, Config(base_url=srv.base_url, model="expert"),
                          EvalConfig(concurrency=2, sandbox=False, vary_environment=True), tmp_path / "eval")
    assert report["overall"]["pass@1"] == 1.0 and report["overall"]["episodes"] == 4
    rows = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    for row in rows:
        v = draw(f"{row['task_id']}/0")
        records = [json.loads(line) for line in open(row["session_path"])]
        system = next(r["message"]["content"] for r in records
                      if r.get("type") == "message" and r["message"]["role"] == "system")
        assert f"- Date: {v.date}" in system
        root = next(line.removeprefix("- Workspace root: ") for line in system.splitlines()
                    if line.startswith("- Workspace root: "))
        assert root.endswith("/".join((*v.dirs, v.name)))
        git = f"- Git repository, branch {v.branch}." if v.branch else "- Not a git repository."
        assert git in system
