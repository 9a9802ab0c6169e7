"""--batch-invariant: a sequence's log-probs are a function of its token ids, whatever else the engine runs
with it, however its prompt is cut into prefill chunks and wherever prefill ends and decode begins."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # The fixed mode's Triton kernels run on a CPU under the interpreter. triton reads the variable when a
    # kernel module is first imported, which the imports below may do (as tests/kernels/conftest.py does
    # for its folder; a whole-suite run has it set from there on already).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from serve.cli import BUILTIN_DIR
from serve.engine.base import SamplingParams
from serve.engine.native import EngineConfig, NativeEngine
from serve.tiny import TinySpec, build_tiny_checkpoint


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 2000, (int(k),), generator=g).tolist() for k in torch.randint(30, 90, (n,), generator=g)]


def run(engine: NativeEngine, batch: list[list[int]]) -> list[tuple[list[int], list[float], list]]:
    """Greedy 24 tokens of each prompt at once, with each step's logprob and top-20 (id, logprob)."""
    async def one(p):
        params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=20)
        ids, lps, tops = [], [], []
        async for t in engine.generate(p, params):
            ids.append(t.id)
            lps.append(t.logprob)
            tops.append(t.top)
        return ids, lps, tops

    async def all_():
        return await asyncio.gather(*(one(p) for p in batch))

    return asyncio.run(all_())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_sequence_gets_the_same_bits_alone_or_in_a_batch_of_8_with_chunked_prefill(dtype):
    ps = prompts(8)
    whole = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype=dtype, batch_invariant=True, kv_cache_tokens=4096))
    chunked = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype=dtype, batch_invariant=True, kv_cache_tokens=4096,
                                                             max_batched_tokens=16))
    try:
        assert "batch-invariant" in whole.describe() and whole.batch_invariant and whole.serve_dtype == dtype
        alone = run(whole, ps[:1])[0]  # its prompt in one prefill step, then decoded alone
        in_batch = run(chunked, ps)  # 16 tokens a step shared by 8 sequences: prefills in chunks, mixed steps
    finally:
        asyncio.run(whole.stop())
        asyncio.run(chunked.stop())
    assert in_batch[0] == alone  # tokens, logprobs and top-20 logprobs: equal floats, not close ones
    assert len({tuple(r[0]) for r in in_batch}) > 1  # the others really are other sequences


def test_batch_invariant_refuses_the_static_step_and_needs_the_native_engine():
    with pytest.raises(ValueError, match="batch-invariant"):
        NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="bfloat16", batch_invariant=True, static_decode=True))


# -- the fixed-order mode (kernels/batch_invariant_triton.py), on a CPU through the Triton interpreter --------


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A real checkpoint small enough for the interpreter (which pays per kernel program): 2 layers, one kv
    head for two q heads, 4 experts top-2, 512 tokens."""
    spec = TinySpec(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32, num_experts=4)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", spec=spec)


def short_prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 500, (int(k),), generator=g).tolist() for k in torch.randint(9, 20, (n,), generator=g)]


def run_short(engine: NativeEngine, batch: list[list[int]], tokens: int = 5):
    async def one(p):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=True, top_logprobs=5)
        return [(t.id, t.logprob, t.top) async for t in engine.generate(p, params)]

    async def all_():
        return await asyncio.gather(*(one(p) for p in batch))

    return asyncio.run(all_())


def test_fixed_mode_same_bits_alone_in_a_batch_and_in_the_trainer(small):
    """bf16 through the fixed-order kernels: a sequence alone (one prefill, eager decode alone) equals the same
    sequence among 3 with its prompt cut into 8-token chunks (8-token pages), mixed prefill/decode steps and
    decode steps through the static step (paged attention in place), and the
    trainer's whole-sequence forward (its kernels, no cache) gives the decode steps' log-probs bit for bit."""
    from train.trainer import Trainer, TrainerConfig

    ps = short_prompts(3)
    # max_model_len: the static step's block tables cover it, and its decode attention runs a program per
    # 64-key split of them (most return at once; the interpreter still pays for each)
    cfg = dict(dtype="bfloat16", batch_invariant="fixed", kv_cache_tokens=512, quant="none", max_model_len=256)
    whole = NativeEngine(str(small), EngineConfig(**cfg))  # eager decode steps
    # decode steps through the static step (the GPU's, CUDA graphs there; serve/model/decode.py fixed_decode_forward)
    chunked = NativeEngine(str(small), EngineConfig(**cfg, max_batched_tokens=8, block_size=8, static_decode=True))
    try:
        assert "fixed-order kernels" in whole.describe() and whole.batch_invariant is True
        assert whole.model.batch_invariant == "fixed" and whole.runner.static is None
        assert chunked.runner.static is not None
        alone = run_short(whole, ps[:1], tokens=4)[0]
        in_batch = run_short(chunked, ps, tokens=4)
    finally:
        asyncio.run(whole.stop())
        asyncio.run(chunked.stop())
    assert chunked.runner.static.steps > 0  # the static step did decode
    assert in_batch[0] == alone  # ids, logprobs and top-5 logprobs: equal floats
    assert len({tuple(t[0] for t in r) for r in in_batch}) > 1

    trainer = Trainer(small, TrainerConfig(dtype="bfloat16", batch_invariant="fixed", mxfp8_experts=False))
    assert trainer.model.batch_invariant == "fixed"
    seqs = [p + [t[0] for t in r] for p, r in zip(ps, in_batch, strict=True)]
    L = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (L - len(s)) for s in seqs])  # right-padded, scored together
    with torch.no_grad():
        lp_BT = trainer._token_logprobs(ids)
    for i, (p, r) in enumerate(zip(ps, in_batch, strict=True)):
        served = torch.tensor([t[1] for t in r])
        scored = lp_BT[i, len(p) - 1: len(p) - 1 + len(r)]
        assert torch.equal(scored, served), (scored - served).abs().max()
    # the trainer's forward is differentiable through the kernels (backward through torch references)
    lp = trainer._token_logprobs(ids[:1, :12])
    lp.sum().backward()
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in trainer.params)


def test_the_mode_is_chosen_in_one_place():
    from serve.model.numerics import resolve_mode

    assert resolve_mode(True, "cpu") == "float64" and resolve_mode(False, "cuda") is None
    assert resolve_mode("float64", "cuda") == "float64"
    with pytest.raises(ValueError, match="one of"):
        resolve_mode("bf16", "cpu")
    assert resolve_mode("fixed", "cpu") == "fixed"  # under the interpreter (set above)
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        with pytest.raises(ValueError, match="interpreter"):  # a CPU without it: a clear refusal
            resolve_mode("fixed", "cpu")
    finally:
        os.environ["TRITON_INTERPRET"] = "1"


def test_the_gpu_bench_invariant_section_runs_its_code_path_at_a_tiny_shape(tmp_path, monkeypatch):
    """bench/gpu.py --sections invariant measures on a GPU; here its code path runs at a tiny shape under the
    interpreter: decode rows of both engines, the ratio rows, and the bitwise row (alone == in a batch,
    the training forward == the decode steps)."""
    import argparse
    import importlib.util
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    monkeypatch.syspath_prepend(str(root / "bench"))
    spec = importlib.util.spec_from_file_location("bench_gpu", root / "bench" / "gpu.py")
    g = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", g)  # the section hands its own module to gpu_invariant
    spec.loader.exec_module(g)
    plan = g.Plan(argparse.Namespace(layers=1, quick=True))
    plan.shape.update(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2)
    plan.prompt_len, plan.invariant_batches, plan.invariant_tokens, plan.invariant_prompts = 10, [2], 3, 3
    report = g.Report(tmp_path / "gpu.json", {})
    g.section_invariant(plan, report, time.perf_counter() + 300)
    sec = report.data["sections"]["invariant"]
    assert not sec["errors"], sec["errors"]
    assert {(r["engine"], r["batch"]) for r in sec["rows"] if r["kind"] == "decode"} == {("default", 2), ("fixed", 2)}
    assert all(r["ratio"] > 0 for r in sec["rows"] if r["kind"] == "ratio")
    (bits,) = [r for r in sec["rows"] if r["kind"] == "bitwise"]
    assert bits["alone_equals_batch"] and bits["trainer_equals_server"] and bits["trainer_gap_max"] == 0.0
    assert "fixed-order kernels" in sec["engine"]
