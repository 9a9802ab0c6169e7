"""`composer-agent index` / `search` print our own lines only: third-party warnings (torchao's failed
extension loads, torch and transformers deprecation notices, Python warnings) go to a log file."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is None, reason="the index extra is not installed"
)
NOISE = re.compile(r"warn|^[WE]\d{4} |Skipping import|Failed to load|it/s\]", re.IGNORECASE)


def run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "XDG_STATE_HOME": str(repo.parent / "state"),
        # torchao then logs a warning when it is imported, on any machine (elsewhere its CUDA
        # extensions fail to load); "always" shows every library deprecation warning.
        "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1",
        "PYTHONWARNINGS": "always",
    }
    env.pop("COMPOSER_EMBED_MODEL", None)
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args, "--cwd", str(repo)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.slow
def test_index_and_search_show_no_third_party_warnings(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for i in range(8):  # enough chunks that indexing loads torch and sentence-transformers
        (repo / f"m{i}.py").write_text(
            f"def scale{i}(x):\n    return x * {i}\n\n\ndef shift{i}(y):\n    return y + {i}\n"
        )

    p = run(repo, "index")
    assert p.returncode == 0, p.stderr
    noise = [ln for ln in (p.stdout + p.stderr).splitlines() if NOISE.search(ln)]
    assert noise == [], "third-party output reached the user:\n" + "\n".join(noise)
    assert p.stderr.splitlines() == ["embedding 16 chunks..."]
    assert p.stdout.startswith("built the index")
    log = (repo / ".composer" / "logs" / "index.log").read_text()
    if importlib.util.find_spec("torchao") is not None:
        assert "Skipping import of cpp extensions" in log  # kept, where a curious user can look

    p = run(repo, "search", "multiply by a factor", "-k", "2")
    assert p.returncode == 0, p.stderr
    assert p.stderr == "" and p.stdout.startswith("m")
