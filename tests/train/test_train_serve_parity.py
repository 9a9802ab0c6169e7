"""Train = serve in low precision: real agent episodes of the built-in model served by composer-serve in
bfloat16 and float16, scored by the trainer in the same dtype. Batch-invariant mode: the trainer's
log-probs equal the server's bit for bit. Default mode: the gap measured (see BENCHMARKS.md)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from agent.tasks import Task
from serve.cli import BUILTIN_DIR
from tests.serve.conftest import start_server
from train.cli import main as train_main
from train.rollout import RolloutConfig, run_episode
from train.trainer import Trainer, TrainerConfig


def episodes(tmp_path: Path, dtype: str, *flags: str, n: int = 4):
    """n episodes at once (so the server batches them and splits prefills into chunks) of a small fixing
    task against the built-in model served in `dtype`; returns (episodes, the /v1/models card)."""
    srv = start_server(BUILTIN_DIR, "--served-model-name", "policy", "--dtype", dtype, "--max-batched-tokens", "64",
                       *flags)
    try:
        card = httpx.get(srv.base_url + "/models").json()["data"][0]
        ws = tmp_path / "ws"
        ws.mkdir(exist_ok=True)
        (ws / "calc.py").write_text("def mean(xs):\n    return sum(xs) / (len(xs) + 1)\n")
        task = Task("mean", "Fix the bug in mean in calc.py.", "true", workspace=str(ws), max_turns=3)
        cfg = RolloutConfig(srv.base_url, "policy", temperature=1.0, max_output_tokens=48)
        with ThreadPoolExecutor(n) as pool:
            eps = list(pool.map(lambda i: run_episode(task, i, cfg, keep_dir=tmp_path / "sessions"), range(n)))
    finally:
        srv.stop()
    assert all(ep.infra_error is None for ep in eps), [ep.infra_error for ep in eps]
    return eps, card


def gaps(eps, dtype: str, invariant: bool) -> torch.Tensor:
    samples = [s for ep in eps for s in ep.samples]
    assert sum(s.sampled_tokens for s in samples) > 40  # T=1 episodes: how many tokens varies
    trainer = Trainer(BUILTIN_DIR, TrainerConfig(dtype=dtype, batch_invariant=invariant))
    out = []
    for s, lp in zip(samples, trainer.logprobs(samples), strict=True):
        m = torch.tensor(s.mask[1:]) > 0
        out.append((lp[m] - torch.tensor(s.sampler_logprobs[1:])[m]).abs())
    return torch.cat(out)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_batch_invariant_server_and_trainer_agree_bit_for_bit(tmp_path, dtype, capsys):
    eps, card = episodes(tmp_path, dtype, "--batch-invariant")
    assert card["serve_dtype"] == dtype and card["batch_invariant"] is True
    g = gaps(eps, dtype, invariant=True)
    assert float(g.max()) == 0.0, (float(g.mean()), float(g.max()))
    # `composer-train check` reads how the session was served from its records and scores it that way
    session = eps[0].session_path
    records = [json.loads(line) for line in Path(session).read_text().splitlines()]
    assert {(r.get("serve_dtype"), r.get("batch_invariant")) for r in records if r["type"] == "request"} == {(dtype, True)}
    # in this process (the CLI's own main and argument parsing): a subprocess only re-imported torch (~3-5 s)
    code = train_main(["check", session, "--model", str(BUILTIN_DIR), "--json", "--tolerance", "0"])
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["served_dtype"] == report["scored_dtype"] == dtype and report["batch_invariant"] is True
    assert report["logprob_gap_max"] == 0.0 and report["ok"] is True and code == 0, out.out + out.err


@pytest.mark.parametrize(("dtype", "mean", "most"), [
    ("float16", 1e-3, 5e-2),  # the goal
    ("bfloat16", 2e-2, 0.3),  # not yet the goal (1e-3, 5e-2): decode kernels and chunked prefill sum otherwise
])
def test_default_mode_gap(tmp_path, dtype, mean, most):
    eps, card = episodes(tmp_path, dtype)
    assert card["serve_dtype"] == dtype and card["batch_invariant"] is False
    g = gaps(eps, dtype, invariant=False)
    assert float(g.mean()) <= mean and float(g.max()) <= most, (float(g.mean()), float(g.max()))


def test_trainer_computes_in_the_served_dtype_on_float32_masters(tmp_path):
    assert Trainer(BUILTIN_DIR).dtype == torch.float64  # the built-in model asks to be served in float64
    tr = Trainer(BUILTIN_DIR, TrainerConfig(dtype="bfloat16", lr=1e-3))
    assert tr.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in tr.params)
    seen = []
    hook = tr.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    lp = tr._token_logprobs(ids)
    hook.remove()
    assert seen == [torch.bfloat16] and lp.dtype == torch.float32
    lp.sum().backward()
    grads = [p.grad for p in tr.params]
    assert all(g is not None and g.dtype == torch.float32 for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)
    with pytest.raises(ValueError, match="dtype"):
        TrainerConfig(dtype="float8")
