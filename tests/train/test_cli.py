"""`composer-train sft` and `check` on a recorded session, and the clear refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent.approval import Approvals
from agent.config import Config
from agent.runtime import build
from serve.tiny import build_tiny_checkpoint
from tests.train.token_server import TokenScriptServer

TURNS = ['<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>',
         "It sets x to 1.<|im_end|>"]


@pytest.fixture(scope="module")
def session(tiny, tmp_path_factory):
    repo = tmp_path_factory.mktemp("ws")
    (repo / "a.py").write_text("x = 1\n")
    with TokenScriptServer(tiny, list(TURNS), [], version=0) as srv:
        config = Config(base_url=srv.base_url, model="scripted", record_tokens=True, approval="auto")
        rt = build(config, repo, emit=lambda e: None, approve=Approvals("auto"))
        assert rt.agent.run("what does a.py do?", rt.system).status == "completed"
        rt.session.close()
    return rt.session.path


def train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train.cli", *args], capture_output=True, text=True, timeout=300)


def test_sft_on_a_recorded_session_writes_a_servable_checkpoint(tiny, session, tmp_path):
    r = train("sft", str(session), "--model", str(tiny), "--out", str(tmp_path / "sft"), "--epochs", "2")
    assert r.returncode == 0, r.stderr
    policy = json.loads((tmp_path / "sft" / "composer_policy.json").read_text())
    assert policy["experts"] == "mxfp8" and policy["step"] == 2
    assert (tmp_path / "sft" / "training" / "optimizer.pt").exists()


def test_check_reports_token_identity(tiny, session):
    r = train("check", str(session), "--model", str(tiny), "--json", "--no-mxfp8")
    report = json.loads(r.stdout)
    assert report["token_identity"].startswith("ok") and report["completion_decode"] == "ok"
    assert report["segments"] == 1 and report["requests"] == 2
    # The scripted server's logprobs are made up, so the gap is large and must be reported as such.
    assert report["logprob_gap_max"] > 0.1 and report["ok"] is False and r.returncode == 1


def test_another_chat_template_is_refused(session, tmp_path):
    coder = build_tiny_checkpoint(tmp_path / "coder", template="qwen3_coder", tokenizer_from=None)
    r = train("sft", str(session), "--model", str(coder), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "another chat template or tokenizer" in r.stderr
    assert not (tmp_path / "x").exists()


def test_another_tool_spec_is_refused(tiny, session, tmp_path):
    lines = open(session).read().splitlines()
    meta = json.loads(lines[0])
    meta["spec_hash"] = "0123456789abcdef"
    (tmp_path / "s.jsonl").write_text("\n".join([json.dumps(meta), *lines[1:]]) + "\n")
    r = train("sft", str(tmp_path / "s.jsonl"), "--model", str(tiny), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "tool spec hash 0123456789abcdef" in r.stderr
