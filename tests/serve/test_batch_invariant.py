"""--batch-invariant: a sequence's log-probs are a function of its token ids, whatever else the engine runs
with it, however its prompt is cut into prefill chunks and wherever prefill ends and decode begins."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serve.cli import BUILTIN_DIR
from serve.engine.base import SamplingParams
from serve.engine.native import EngineConfig, NativeEngine


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
