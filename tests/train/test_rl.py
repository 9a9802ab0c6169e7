"""`composer-train rl` end to end on the tiny checkpoint: real composer-serve, real agent loop, real
weight sync. The verify command is a coin flip so that rewards vary within groups (a random model
solves nothing); what is tested is the machinery, not learning."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from agent.tasks import load_tasks
from train.cli import main as train_main
from train.progress import Progress
from train.rl import RLConfig, run
from train.trainer import TrainerConfig


def suite(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    lines = [json.dumps({"id": f"coin-{i}", "workspace": "ws", "prompt": f"fix calc.py ({i})",
                         "verify": "test $((RANDOM % 2)) -eq 0", "max_turns": 1}) for i in range(3)]
    (tmp_path / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    return load_tasks(tmp_path / "tasks.jsonl")


def quiet(steps):
    return Progress(steps, out=open("/dev/null", "w"))  # noqa: SIM115


@pytest.mark.slow
def test_rl_steps_sync_weights_and_resume(tiny, tmp_path, capsys):
    tasks, out = suite(tmp_path), tmp_path / "run"
    cfg = RLConfig(steps=2, group_size=4, groups_per_step=2, workers=3, max_staleness=0, save_every=1,
                   max_output_tokens=12)
    threads = torch.get_num_threads()
    hist = run(tiny, tasks, out, cfg, trainer_cfg=TrainerConfig(lr=1e-2), progress=quiet(2))
    assert torch.get_num_threads() == threads  # the trainer's half of the CPU is given back
    assert [m["step"] for m in hist] == [0, 1] and [m["policy_version"] for m in hist] == [0, 1]
    assert all(m["infra_masked"] == 0 and m["dropped_stale"] == 0 for m in hist)
    assert hist[0]["logprob_gap_max"] <= 1e-4  # step 0's episodes were sampled by exactly these weights
    assert (out / "metrics.png").stat().st_size > 1000
    # pass@k and best-of-K over each step's groups of 4, and every reward term, logged per step (issue 56)
    assert {"pass@1", "pass@2", "pass@4", "best_of_k_reward", "best_of_k_pass", "reward_evidence", "reward_turns",
            "reward_calls", "unsupported_per_episode", "turns_mean", "tool_calls_mean"} <= set(hist[0])
    assert hist[0]["best_of_k"] == 4

    # The step changed the weights, and the server sampled the next batch with them (version 1).
    base = load_file(str(tiny / "model.safetensors"))
    masters = load_file(str(out / "checkpoints" / "step-1" / "training" / "masters.safetensors"))
    changed = not torch.equal(masters["layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    # A coin-flip group can come out all heads (p = 1/8 per group): then advantages, and the update, are 0.
    assert changed == (hist[0]["grad_norm"] > 0)
    eps = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert {e["min_version"] for e in eps if e["step"] == 1} == {1}
    batch1 = sorted((out / "trajectories" / "batch-1").glob("*.jsonl"))[0]
    # `composer-train check` in this process (its main and argument parsing): a subprocess re-imported torch
    check = ["check", str(batch1), "--json"]
    capsys.readouterr()
    assert train_main([*check, "--model", str(out / "checkpoints" / "step-1")]) == 0
    new = json.loads(capsys.readouterr().out)
    assert new["ok"] and new["sampled_by_versions"] == [1] and new["logprob_gap_max"] <= 1e-4
    if changed:
        train_main([*check, "--model", str(tiny), "--no-mxfp8"])
        old = json.loads(capsys.readouterr().out)
        assert old["logprob_gap_max"] > 1e-3  # the old weights did not produce it

    # --resume continues at step 2 from the last checkpoint, with the staleness bound relaxed to 1.
    cfg3 = RLConfig(steps=3, group_size=4, groups_per_step=2, workers=3, max_staleness=1, save_every=1,
                    max_output_tokens=12)
    hist2 = run(tiny, tasks, out, cfg3, trainer_cfg=TrainerConfig(lr=1e-2), resume=True, progress=quiet(3))
    assert [m["step"] for m in hist2] == [2] and hist2[0]["policy_version"] == 2
    assert all(m["staleness_mean"] <= 1 for m in hist2)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
