"""The LM head as served on a CPU (Qwen3MoeModel.logits: one GEMM with the vocabulary as its long side, a
single row doubled) gives F.linear's logits for any number of rows, tied to the embeddings or not; the
projections' few rows (numerics.proj, W·xᵀ) give F.linear's outputs too."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from serve.cli import BUILTIN_DIR
from serve.model.config import ModelConfig
from serve.model.numerics import proj
from serve.model.qwen3_moe import Qwen3MoeModel


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logits_match_f_linear_at_every_row_count(tied, dtype):
    cfg = replace(ModelConfig.from_dir(BUILTIN_DIR), num_hidden_layers=1, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen3MoeModel(cfg).to(dtype)
    w = model.embed_tokens.weight if tied else model.lm_head.weight
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    for n in (0, 1, 2, 3, 9):
        h = torch.randn(n, cfg.hidden_size, dtype=dtype)
        with torch.inference_mode():
            got = model.logits(h)
        want = F.linear(h, w)
        assert got.shape == (n, cfg.vocab_size) and got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_a_served_steps_logits_come_as_contiguous_float32_rows():
    """The runner's logits ([rows, V]) are laid out by row, whatever the head computed (transposed on a
    CPU): the sampler's per-row reductions would otherwise stride across the vocabulary (~4x slower for a
    verify step's rows)."""
    import asyncio

    from serve.engine.base import SamplingParams
    from serve.engine.native import EngineConfig, NativeEngine
    from serve.engine.sequence import Sequence

    engine = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=2, cpu_kernels=False))
    try:
        seq = Sequence(list(range(10, 40)), SamplingParams(max_tokens=8))
        engine.blocks.allocate(seq)
        _, first = engine.runner.run([(seq, 30)])
        seq.num_computed = 30
        seq.token_ids.append(5)
        engine.blocks.ensure(seq, 40)
        seq.draft = [6, 7, 8]
        _, verify = engine.runner.run([(seq, 4)])
        for logits, rows in ((first, 1), (verify, 4)):
            assert logits.shape == (rows, engine.model.cfg.vocab_size) and logits.dtype == torch.float32
            assert logits.is_contiguous()
    finally:
        asyncio.run(engine.stop())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_projections_few_rows_match_f_linear(dtype):
    torch.manual_seed(1)
    m = torch.nn.Linear(128, 256, bias=False, dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for n in (1, 2, 5, 16, 17):
        x = torch.randn(n, 128, dtype=dtype)
        with torch.inference_mode():
            got = proj(m, x, False)
        assert got.shape == (n, 256) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, m.weight), rtol=0, atol=tol)
