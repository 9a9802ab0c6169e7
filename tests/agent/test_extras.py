"""Installed without an extra, or on a port that is taken: one line saying what to do, never a traceback.

The extras' packages are made unimportable in a real subprocess (a sitecustomize that answers
ModuleNotFoundError for them, as if they had never been installed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent

BLOCKER = """
import importlib.abc, sys
BLOCKED = set({blocked!r})
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
"""
INDEX = ["numpy", "faiss", "sentence_transformers", "scipy", "Stemmer", "tree_sitter", "git", "tqdm"]
SERVE = ["torch", "transformers", "safetensors", "tokenizers", "fastapi", "uvicorn", "jinja2"]


def without(tmp_path: Path, blocked: list[str], cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked))
    env = {**os.environ, "PYTHONPATH": str(site), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("args", [["index"], ["search", "where is main"]], ids=["index", "search"])
def test_index_and_search_without_the_index_extra_say_which_extra(tmp_path, args):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.py").write_text("def main():\n    return 1\n")
    p = without(tmp_path, INDEX, [str(BIN / "composer-agent"), *args], repo)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "`index` extra" in p.stderr and "pip install" in p.stderr


def test_composer_serve_without_the_serve_extra_says_which_extra(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    p = without(tmp_path, SERVE, [str(BIN / "composer-serve"), "--model", str(model), "--port", "0"], tmp_path)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "`serve` extra" in p.stderr


def test_serve_tiny_without_the_serve_extra_says_which_extra(tmp_path):
    p = without(tmp_path, SERVE, [sys.executable, "-m", "serve.tiny", str(tmp_path / "tiny")], tmp_path)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "`serve` extra" in p.stderr


def test_a_port_in_use_is_a_message(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"content": "hi"}]))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for cmd in ([sys.executable, "-m", "agent.scripted", str(script), "--port", port],
                    [str(BIN / "composer-serve"), "--model", str(model), "--port", port]):
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
            assert port in p.stderr and "in use" in p.stderr
