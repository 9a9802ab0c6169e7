"""Colocated RL (train/colocate.py): the native engine and the trainer in one process, the new weights
copied into the engine's own tensors after each step, its KV cache freed while the trainer steps.

Real pieces throughout: the tiny checkpoint, the real trainer step, the engine's real OpenAI API on a
loopback port, the real agent loop and tools for rollouts, and the disk path (a saved checkpoint loaded
by a second engine) as the reference the in-memory hand-over must equal bit for bit."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import httpx
import pytest
import torch

from kernels import MXFP8Tensor, cpu_pack
from serve.engine.base import SamplingParams
from serve.engine.native import EngineConfig, NativeEngine
from serve.engine.parity import forced_logits
from serve.model.config import QWEN3_30B_A3B, ModelConfig
from serve.model.fp8 import FP8Linear
from serve.model.loader import load_model
from serve.model.qwen3_moe import Qwen3MoeModel
from train.cli import main as train_main
from train.colocate import ColocateConfig, Colocated, copy_weights_
from train.memory_plan import GIB, PlanDoesNotFit, colocated_plan, memory_plan
from train.samples import Sample
from train.trainer import Trainer, TrainerConfig

IDS = [(i * 37) % 900 + 40 for i in range(40)]
SPLIT = 30


def engine_tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor the engine computes with, by name (MXFP8 experts as data, scales and dense copy)."""
    out = {n: p for n, p in model.named_parameters()}
    for i, moe in enumerate(model.moe_layers()):
        for name in ("w13", "w2"):
            w = getattr(moe, name)
            if isinstance(w, MXFP8Tensor):
                out |= {f"{i}.{name}.data": w.data, f"{i}.{name}.scales": w.scales.view(torch.uint8)}
                if w.dense is not None:
                    out[f"{i}.{name}.dense"] = w.dense
            else:
                out[f"{i}.{name}"] = w
    return out


def engine_logprobs(engine: NativeEngine) -> torch.Tensor:
    """The engine's log-prob of IDS[SPLIT:], one prefill then decode steps, on its own thread."""
    logits = engine.call_idle(lambda: forced_logits(engine, IDS, SPLIT))
    return torch.log_softmax(logits[:-1].double(), -1).gather(-1, torch.tensor(IDS[SPLIT:])[:, None])[:, 0]


def trainer_logprobs(trainer: Trainer, full: bool = False) -> torch.Tensor:
    """The trainer's log-prob of IDS[SPLIT:] (with `full`, of IDS[1:])."""
    sample = Sample("e", 0, token_ids=list(IDS), mask=[1] * len(IDS), sampler_logprobs=[0.0] * len(IDS))
    lp = trainer.logprobs([sample])[0].double()
    return lp if full else lp[SPLIT - 1:]


def step_on(trainer: Trainer) -> dict:
    """One real RL step on a made-up sample: its last tokens, sampled by the current weights, reinforced."""
    lp = [0.0] + trainer_logprobs(trainer, full=True).tolist()
    sample = Sample("e", 0, token_ids=list(IDS), mask=[0] * SPLIT + [1] * (len(IDS) - SPLIT),
                    sampler_logprobs=[x if i >= SPLIT else 0.0 for i, x in enumerate(lp)],
                    versions=[trainer.policy_version])
    out = trainer.step([sample], [1.0])
    assert out["grad_norm"] > 0
    return out


def test_hand_over_in_memory_equals_the_disk_path(tiny, tmp_path):
    trainer = Trainer(tiny, TrainerConfig(lr=1e-2))
    colo = Colocated(tiny, trainer, ColocateConfig(kv_cache_tokens=1024, max_num_seqs=4, max_model_len=1024))
    try:
        engine = colo.engine
        # served from the start: the trainer's weights (the engine was made with random ones)
        assert engine.policy_version == trainer.policy_version
        before = engine_logprobs(engine)
        assert (before - trainer_logprobs(trainer)).abs().max() < 1e-4
        ptrs = {n: t.data_ptr() for n, t in engine_tensors(engine.model).items()}
        kv = engine.kv_tensors()
        kv_ids, kv_bytes = [id(t) for t in kv], sum(t.untyped_storage().nbytes() for t in kv)
        assert kv_bytes > 0

        slept = colo.sleep()
        assert slept["kv_freed_bytes"] == kv_bytes
        assert all(t.untyped_storage().nbytes() == 0 for t in engine.kv_tensors())  # the memory is gone
        step_on(trainer)
        handed = colo.hand_over()
        woke = colo.wake()
        assert woke["kv_restored_bytes"] == kv_bytes and [id(t) for t in engine.kv_tensors()] == kv_ids
        assert sum(t.untyped_storage().nbytes() for t in engine.kv_tensors()) == kv_bytes

        assert handed["policy_version"] == engine.policy_version == 1 and handed["experts_quantized"] == 4
        assert {n: t.data_ptr() for n, t in engine_tensors(engine.model).items()} == ptrs  # nothing reallocated
        after = engine_logprobs(engine)
        assert (after - before).abs().max() > 1e-3  # the engine's outputs changed ...
        assert (after - trainer_logprobs(trainer)).abs().max() < 1e-4  # ... to the trainer's at its new weights

        # the disk path's engine, from the checkpoint the trainer writes: the same tensors, bit for bit
        saved = trainer.save(tmp_path / "v1", resumable=False)
        disk = NativeEngine(str(saved), EngineConfig(dtype="float32", quant="mxfp8", kv_cache_tokens=1024,
                                                     max_model_len=1024, max_num_seqs=4))
        try:
            ours, theirs = engine_tensors(engine.model), engine_tensors(disk.model)
            assert ours.keys() == theirs.keys()
            for name, t in ours.items():
                assert torch.equal(t, theirs[name]), name
            assert torch.equal(engine_logprobs(disk), after)
        finally:
            disk._stop.set()

        # through the API: the completion reports the new version
        r = httpx.post(colo.base_url + "/completions", json={"model": "policy", "prompt": "def f():", "max_tokens": 4},
                       headers={"Authorization": f"Bearer {colo.api_key}"}, timeout=60)
        assert r.status_code == 200 and r.json()["policy_version"] == 1
    finally:
        colo.stop()


def greedy(engine: NativeEngine, n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens after IDS[:SPLIT] and their log-probs, through the engine's generate."""

    async def go():
        out = [t async for t in engine.generate(IDS[:SPLIT], SamplingParams(max_tokens=n, temperature=0.0, logprobs=True))]
        return [t.id for t in out], [t.logprob for t in out]

    return asyncio.run(go())


def test_the_static_decode_step_serves_the_handed_over_weights(tiny):
    """The GPU's decode step (persistent buffers; captured in CUDA graphs there) run on a CPU: after a hand-over
    and a KV release/restore it decodes with the new weights, its buffers the same storages as before."""
    trainer = Trainer(tiny, TrainerConfig(lr=1e-2))
    colo = Colocated(tiny, trainer, ColocateConfig(kv_cache_tokens=1024, max_num_seqs=4, max_model_len=1024,
                                                   static_decode=True))
    try:
        static = colo.engine.runner.static
        buffers = (static.host.data_ptr(), static.dev.data_ptr())
        greedy(colo.engine, 6)
        steps = static.steps
        assert steps > 0  # decode steps took the static path
        colo.sleep()
        step_on(trainer)
        colo.hand_over()
        colo.wake()
        ids, lps = greedy(colo.engine, 6)
        assert static.steps > steps and (static.host.data_ptr(), static.dev.data_ptr()) == buffers
        sample = Sample("g", 0, token_ids=IDS[:SPLIT] + ids, mask=[1] * (SPLIT + 6), sampler_logprobs=[0.0] * (SPLIT + 6))
        want = trainer.logprobs([sample])[0][SPLIT - 1:]
        assert (torch.tensor(lps) - want).abs().max() < 1e-4  # the trainer's, at its new weights
    finally:
        colo.stop()


def test_requests_wait_while_the_kv_cache_is_released(tiny):
    trainer = Trainer(tiny, TrainerConfig())
    colo = Colocated(tiny, trainer, ColocateConfig(kv_cache_tokens=1024, max_num_seqs=4, max_model_len=1024))
    try:
        colo.sleep()
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("r", httpx.post(
            colo.base_url + "/completions", json={"model": "policy", "prompt": "x = 1", "max_tokens": 3},
            headers={"Authorization": f"Bearer {colo.api_key}"}, timeout=60)))
        t.start()
        t.join(1.0)
        assert t.is_alive() and "r" not in got  # held: no KV cache to run it in
        colo.wake()
        t.join(30)
        assert got["r"].status_code == 200 and len(got["r"].json()["choices"][0]["text"]) >= 0
    finally:
        colo.stop()


def test_copy_into_fused_packed_and_plain_layouts(tiny, tmp_path):
    """Every layout an engine can hold on a CPU: q/k/v fused, every linear layer oneDNN-packed, experts
    plain and stored input-major (what pack_for_cpu does without the C++ kernels), bfloat16 serving."""
    if not cpu_pack.available(torch.float32):
        pytest.skip("no oneDNN packing in this torch build")
    trainer = Trainer(tiny, TrainerConfig(lr=1e-2, mxfp8_experts=False))
    step_on(trainer)
    saved = trainer.save(tmp_path / "v1", resumable=False)

    def packed(path):
        m = load_model(path, dtype=torch.float32, quant="none")
        m.pack_for_cpu(min_linear_elements=1)
        return m

    dst, ref = packed(tiny), packed(saved)
    for m in (dst, ref):  # one block-FP8 layer too (--quant-dense fp8 on a GPU)
        m.layers[1].self_attn.o_proj = FP8Linear.from_linear(load_model(tiny, dtype=torch.float32).layers[1].self_attn.o_proj)
    ref.layers[1].self_attn.o_proj = FP8Linear.from_linear(load_model(saved, dtype=torch.float32).layers[1].self_attn.o_proj)
    assert isinstance(dst.layers[0].self_attn.qkv_proj, cpu_pack.PackedLinear)
    assert not dst.moe_layers()[0].w13.is_contiguous()  # input-major
    copy_weights_(dst, trainer.model)
    for (name, a), b in zip(dst.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for mod, rmod in zip(dst.modules(), ref.modules(), strict=True):
        if isinstance(mod, cpu_pack.PackedLinear):
            x = torch.randn(3, mod.in_features)
            assert torch.equal(mod(x), rmod(x))
    for moe, rmoe in zip(dst.moe_layers(), ref.moe_layers(), strict=True):
        assert torch.equal(moe.w13, rmoe.w13) and torch.equal(moe.w2, rmoe.w2)
    one_layer = Qwen3MoeModel(replace(ModelConfig.from_dir(tiny), num_hidden_layers=1))
    with pytest.raises(ValueError, match="different shapes"):
        copy_weights_(dst, one_layer)


def test_colocated_rl_steps_through_the_cli(tiny, tmp_path, capsys):
    """Two synchronous steps of `composer-train rl --colocate`: real rollouts through the agent loop and its
    tools against the engine in this process, the weights handed over in memory (no policy/ folder), step
    1 sampled by version 1 at exactly the trainer's weights."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(
        {"id": f"coin-{i}", "workspace": "ws", "prompt": f"fix calc.py ({i})", "verify": "test $((RANDOM % 2)) -eq 0",
         "max_turns": 1}) + "\n" for i in range(2)))
    out = tmp_path / "run"
    common = ["rl", "--model", str(tiny), "--tasks", str(tasks), "--out", str(out)]
    assert train_main([*common, "--steps", "2", "--group-size", "2", "--groups-per-step", "1", "--workers", "2",
                       "--max-output-tokens", "8", "--lr", "1e-2", "--save-every", "2", "--colocate",
                       "--kv-cache-tokens", "16384"]) == 0
    hist = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in hist] == [0, 1]
    for m in hist:
        assert m["infra_masked"] == 0 and m["completion_tokens"] > 0
        assert m["logprob_gap_max"] <= 1e-4  # sampled by the engine at exactly the trainer's weights
        assert m["hand_over_s"] > 0 and m["hand_over_bytes"] > 0
        assert m["kv_freed_bytes"] > 0 and m["kv_restored_bytes"] == m["kv_freed_bytes"]
    eps = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert {e["min_version"] for e in eps if e["step"] == 1} == {1}
    assert not (out / "policy").exists() and (out / "checkpoints" / "step-2").is_dir()
    capsys.readouterr()
    assert train_main([*common, "--colocate", "--max-staleness", "1"]) == 2
    assert "synchronous" in capsys.readouterr().err
    assert train_main([*common, "--kv-cache-tokens", "4096"]) == 2
    assert "give --colocate too" in capsys.readouterr().err


def test_colocated_memory_plan_at_the_30b_shape(tmp_path):
    """8 layers of Qwen3-30B-A3B (5.6 B parameters): on an H200 (141 GiB) the KV cache gets what the
    rollouts leave and is not counted in the trainer's step unless kept; an 80 GiB GPU cannot hold the
    trainer's fp32 masters, gradients and AdamW moments (16 bytes a parameter) beside the engine."""
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": 8}))
    cfg = ModelConfig.from_dir(tmp_path)
    train = memory_plan(cfg, micro_batch_tokens=4096)
    reserve = 64 * cfg.vocab_size * 48 + 2**30
    plan = colocated_plan(train, cfg, serve_bytes=2, mxfp8_experts=True, engine_reserve=reserve, capacity=141 * GIB)
    plan.check(141 * GIB)
    assert plan.rollout_total <= 141 * GIB < plan.rollout_total + 2 * plan.kv_bytes_per_token * 1.1
    assert plan.kv_bytes_per_token == 2 * 8 * 4 * 128 * 2 and plan.kv_tokens > 100_000
    assert not any("KV" in name for name, _ in plan.train.rows)  # released while the trainer steps
    assert plan.train.total < 141 * GIB < plan.train.total + plan.kv_tokens * plan.kv_bytes_per_token
    assert "engine weights (MXFP8 experts)" in plan.table() and "rollouts:" in plan.table()
    kept = colocated_plan(train, cfg, serve_bytes=2, mxfp8_experts=True, engine_reserve=reserve, release_kv=False,
                          capacity=141 * GIB)
    assert kept.kv_tokens < plan.kv_tokens and any("KV" in name for name, _ in kept.train.rows)
    kept.check(141 * GIB)
    with pytest.raises(PlanDoesNotFit, match="no room for a KV"):
        colocated_plan(train, cfg, serve_bytes=2, mxfp8_experts=True, engine_reserve=reserve, capacity=80 * GIB)


def test_plan_command_shows_the_colocated_plan(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": 8}))
    assert train_main(["plan", "--model", str(tmp_path), "--gpu-memory", "141", "--colocate", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["fits"] and got["kv_tokens"] > 100_000 and got["train_bytes"] < 141 * GIB
    assert any(k.startswith("engine weights") for k in got["train_rows"])
    assert train_main(["plan", "--model", str(tmp_path), "--gpu-memory", "80", "--colocate"]) == 1
    out, err = capsys.readouterr()
    assert "rollouts:" in out and "no room for a KV cache" in err
    assert train_main(["plan", "--model", str(tmp_path), "--gpu-memory", "141", "--colocate",
                       "--kv-cache-tokens", "5000000"]) == 1
    assert "together" in capsys.readouterr().err


def test_copy_into_experts_blocked_for_the_cpu_kernel(tiny, tmp_path):
    """pack_for_cpu with our C++ kernels blocks plain experts for them (kernels/moe.py block_experts)."""
    from kernels import cpu_ext

    kernels = cpu_ext.load(build_in_background=False)
    if kernels is None:
        pytest.skip("the CPU kernels are not built here (python -m kernels.cpu_ext)")
    trainer = Trainer(tiny, TrainerConfig(lr=1e-2, mxfp8_experts=False))
    step_on(trainer)
    saved = trainer.save(tmp_path / "v1", resumable=False)

    def packed(path):
        m = load_model(path, dtype=torch.float32, quant="none")
        m.pack_for_cpu(min_linear_elements=1, cpu_kernels=kernels)
        return m

    dst, ref = packed(tiny), packed(saved)
    assert dst.moe_layers()[0].w13.dim() == 4  # blocked
    copy_weights_(dst, trainer.model)
    for moe, rmoe in zip(dst.moe_layers(), ref.moe_layers(), strict=True):
        assert torch.equal(moe.w13, rmoe.w13) and torch.equal(moe.w2, rmoe.w2)
