"""bench/tiny_heldout.py --samples: every task runs K times and pass@K counts the tasks solved at least once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILTIN = ROOT / "serve" / "builtin" / "composer-tiny"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_samples_give_pass_at_k_from_each_tasks_solve_count(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "tiny_heldout.py"), f"tiny={BUILTIN}", "--families", "bugfix",
           "--seeds", "3", "--kinds", "seen", "--max-turns", "8", "--temperature", "1", "--samples", "2",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=580)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "heldout.json").read_text())["results"]["tiny"]["seen"]
    solved = res["solved"]
    assert len(solved) == 3 and all(0 <= c <= 2 for c in solved.values())
    assert res["pass@1"] == round(sum(solved.values()) / 6, 4)
    assert res["pass@k"] == round(sum(c > 0 for c in solved.values()) / 3, 4) >= res["pass@1"]
    assert sum(solved.values()) > 0  # the built-in model solves bugfix tasks more often than not
    assert (tmp_path / "heldout.png").exists()


def test_samples_need_a_temperature(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "tiny_heldout.py"), f"tiny={BUILTIN}", "--samples", "4",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and "--temperature > 0" in done.stderr
