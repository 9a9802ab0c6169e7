"""`bench/gpu.py --sections rl` (bench/gpu_rl.py) on a CPU: its tiny shape runs one colocated RL step end to
end and reports every figure the GPU run will (no figure here is about a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~20 s on 2 cores; the loop itself runs in CI through tests/train/test_colocate.py
def test_rl_section_reports_its_figures(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--sections", "rl", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("gpu-*-cpu-reduced.json")
    sec = json.loads(path.read_text())["sections"]["rl"]
    assert sec["status"] == "ok" and not sec["errors"]
    (step,) = [r for r in sec["rows"] if r["kind"] == "step"]
    assert step["completion_tokens"] > 0 and step["rollout_tok_s"] > 0 and step["train_tok_s"] > 0
    assert set(step["phases_s"]) == {"forward", "backward", "optimizer"}
    assert step["kv_freed_bytes"] > 0 and step["hand_over_s"] > 0 and step["logprob_gap_max"] <= 1e-4
    (hand,) = [r for r in sec["rows"] if r["kind"] == "hand_over"]
    assert 0 < hand["memory_s"] and 0 < hand["disk_save_s"] and 0 < hand["disk_load_s"]
    assert hand["bytes_written"] > 0 and hand["checkpoint_bytes"] > 0
    assert sec["shape"]["config"]["num_hidden_layers"] == 2 and "KV cache" in sec["shape"]["engine"]["describe"]
    assert json.loads(path.read_text())["meta"]["sections"] == ["rl"]

