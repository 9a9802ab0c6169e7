"""Speculative decoding in the native engine (serve/engine/speculation.py): whatever is drafted, a request
gets what it gets without speculation: the same greedy tokens, the same seeded samples, the same logprobs,
stop and length handling, routed experts; rejected draft tokens leave nothing in the prefix cache."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from serve.cli import BUILTIN_DIR
from serve.engine.base import SamplingParams
from serve.engine.native import EngineConfig, NativeEngine

SOURCE = Path(textwrap.__file__).read_text()


def prompts() -> list[list[int]]:
    """Real code (the standard library's textwrap), which repeats itself: drafts get proposed and tested."""
    tok = Tokenizer.from_file(str(BUILTIN_DIR / "tokenizer.json"))
    ids = tok.encode(SOURCE[:6000]).ids
    return [ids[:300], ids[100:700], ids[40:90] * 3, ids[500:520]]


def run_all(engine: NativeEngine, ps: list[list[int]], params: SamplingParams) -> list[list]:
    async def one(p):
        return [t async for t in engine.generate(p, params)]

    async def main():
        return await asyncio.gather(*(one(p) for p in ps))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def engines():
    made = {}
    for spec in ("off", "suffix", "ngram"):
        # every proposal verified (not only where the timings say it pays): each test sees drafts rejected
        # and accepted, whatever the machine's load
        made[spec] = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", speculative=spec, max_num_seqs=8,
                                                                 num_speculative_tokens=6, speculative_adaptive=False))
    yield made
    for e in made.values():
        asyncio.run(e.stop())


PARAMS = [
    SamplingParams(max_tokens=60, temperature=0.0, logprobs=True, top_logprobs=3, return_routed_experts=True),
    SamplingParams(max_tokens=60, temperature=1.0, seed=7, logprobs=True),
    SamplingParams(max_tokens=60, temperature=0.8, top_p=0.9, top_k=40, seed=3),
    SamplingParams(max_tokens=13, temperature=0.0),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy-logprobs-routes", "seeded", "top-p-top-k", "max-tokens"])
@pytest.mark.parametrize("spec", ["suffix", "ngram"])
def test_speculation_changes_nothing_a_request_gets(engines, spec, params):
    before = engines[spec].spec.drafted
    want = run_all(engines["off"], prompts(), params)
    got = run_all(engines[spec], prompts(), params)
    assert engines[spec].spec.drafted > before, "nothing was drafted: the test would prove nothing"
    for w_seq, g_seq in zip(want, got, strict=True):
        assert [t.id for t in g_seq] == [t.id for t in w_seq]
        assert len(g_seq) == min(params.max_tokens, len(w_seq))
        for w, g in zip(w_seq, g_seq, strict=True):
            if params.logprobs:
                assert g.logprob == pytest.approx(w.logprob, abs=1e-9)
            if params.top_logprobs:
                assert [t for t, _ in g.top] == [t for t, _ in w.top]
        if params.return_routed_experts:
            assert torch.equal(g_seq[-1].routed_experts, w_seq[-1].routed_experts)


def test_accepted_drafts_are_reported_on_the_tokens(engines):
    got = run_all(engines["suffix"], [prompts()[2]], SamplingParams(max_tokens=60, temperature=0.0))[0]
    drafted = sum(t.drafted for t in got)
    accepted = sum(t.accepted for t in got)
    assert drafted > 0 and 0 < accepted <= drafted
    stats = engines["suffix"].stats()
    assert stats.spec_drafted >= drafted and stats.spec_accepted >= accepted and stats.spec_verifies > 0


def test_a_prompts_opening_is_drafted_and_verified_in_its_prefill(engines):
    """A prompt asked again: the cache of recent outputs knows what followed its tail, so the prefill's
    forward verifies that as a draft after the prompt and the first token event already carries a tested
    and kept draft: several tokens from one forward, the tokens of an engine that never speculates."""
    tok = Tokenizer.from_file(str(BUILTIN_DIR / "tokenizer.json"))
    p = tok.encode(SOURCE[9000:9400]).ids[:40]  # text no other test's prompt holds
    params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=True)
    want = run_all(engines["off"], [p], params)[0]
    first = run_all(engines["suffix"], [p], params)[0]
    again = run_all(engines["suffix"], [p], params)[0]
    for got in (first, again):
        assert [t.id for t in got] == [t.id for t in want]
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-9)
    assert again[0].drafted > 0 and again[0].accepted, "the prefill verified no draft, or kept none of it"


def test_a_chunked_prefill_drafts_only_in_its_last_chunk():
    """A prompt longer than a step's token budget is prefilled in chunks; its draft rides with the last
    one (trimmed to the budget): same tokens as without speculation, greedy and seeded."""
    cfg = dict(dtype="float64", max_num_seqs=4, max_batched_tokens=64, block_size=16)
    plain = NativeEngine(str(BUILTIN_DIR), EngineConfig(**cfg))
    spec = NativeEngine(str(BUILTIN_DIR), EngineConfig(speculative="suffix", num_speculative_tokens=6,
                                                       speculative_adaptive=False, **cfg))
    try:
        ps = [prompts()[2], prompts()[2][:125], prompts()[0][:60]]  # 150, 125 (the last chunk 61 + 3 fit) and 60
        for params in (SamplingParams(max_tokens=20, temperature=0.0, logprobs=True),
                       SamplingParams(max_tokens=20, temperature=1.0, seed=9)):
            want, got = run_all(plain, ps, params), run_all(spec, ps, params)
            assert [[t.id for t in s] for s in got] == [[t.id for t in s] for s in want]
        assert spec.spec.drafted > 0 and spec.spec.accepted > 0
    finally:
        asyncio.run(plain.stop())
        asyncio.run(spec.stop())


def test_rejected_draft_tokens_never_reach_the_prefix_cache():
    """Every block the prefix cache holds is a block of tokens a sequence really had (a fresh engine, so
    nothing else was ever cached)."""
    eng = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", speculative="suffix", max_num_seqs=8,
                                                      speculative_adaptive=False))
    try:
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=11)
        outs = run_all(eng, prompts(), params)
        assert eng.stats().spec_drafted > eng.stats().spec_accepted > 0  # drafts were accepted and rejected
        real = [p + [t.id for t in out] for p, out in zip(prompts(), outs, strict=True)]
        bs = eng.config.block_size
        blocks = {tuple(seq[i : i + bs]) for seq in real for i in range(0, len(seq) - bs + 1, bs)}
        cached = [b.tokens for b in eng.blocks.blocks if b.hash is not None]
        assert len(cached) > 20
        assert all(tokens in blocks for tokens in cached)
    finally:
        asyncio.run(eng.stop())


def test_a_later_request_sharing_the_prefix_gets_the_same_tokens(engines):
    """A follow-up turn (prompt = earlier prompt + its answer + more) through the prefix cache the first
    turn filled with speculation: the same tokens as without speculation."""
    first = prompts()[1]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    answers = {k: [t.id for t in run_all(engines[k], [first], params)[0]] for k in ("off", "suffix")}
    assert answers["off"] == answers["suffix"]
    follow = first + answers["off"] + prompts()[3]
    got = {k: [t.id for t in run_all(engines[k], [follow], params)[0]] for k in ("off", "suffix")}
    assert got["off"] == got["suffix"]
    assert engines["suffix"].stats().prefix_cache_hits > 0


def test_a_scope_never_drafts_from_another_scopes_outputs(engines):
    eng = engines["suffix"]
    run_all(eng, [prompts()[0]], SamplingParams(max_tokens=30, temperature=0.0, draft_scope="alice"))
    stores = eng.spec.cache.stores
    assert "alice" in stores
    alice = stores["alice"].tokens
    assert eng.spec.cache.propose("bob", alice[-20:-10], 5).tokens == []
    assert eng.spec.cache.propose("alice", alice[-20:-10], 5).tokens


def test_the_static_step_verifies_drafts_with_the_eager_tokens(tiny_hermes):
    """The GPU's static step (run here without capture) verifies drafts as rows of the decode step: same
    tokens and logprobs as an engine that never speculates."""
    cfg = dict(dtype="float32", max_model_len=256, max_num_seqs=4)
    plain = NativeEngine(str(tiny_hermes), EngineConfig(static_decode=False, **cfg))
    static = NativeEngine(str(tiny_hermes), EngineConfig(static_decode=True, speculative="suffix",
                                                         speculative_adaptive=False, **cfg))
    try:
        g = torch.Generator().manual_seed(5)
        base = torch.randint(3, 1000, (12,), generator=g).tolist()
        # short: in a full test run the Triton interpreter is on, and the static step runs its kernels there
        ps = [base * 4, torch.randint(3, 1000, (20,), generator=g).tolist()]
        for params in (SamplingParams(max_tokens=14, temperature=0.0, logprobs=True),
                       SamplingParams(max_tokens=14, temperature=1.0, seed=4, logprobs=True)):
            want, got = run_all(plain, ps, params), run_all(static, ps, params)
            assert [[t.id for t in s] for s in got] == [[t.id for t in s] for s in want]
            for gs, ws in zip(got, want, strict=True):
                assert [t.logprob for t in gs] == pytest.approx([t.logprob for t in ws], abs=1e-4)
        assert static.runner.static.steps > 0 and static.spec.drafted > 0
    finally:
        asyncio.run(plain.stop())
        asyncio.run(static.stop())


@pytest.mark.gpu
def test_cuda_graphs_verify_drafts_with_the_eager_tokens(tiny_hermes):
    """On a GPU: verify steps replayed from CUDA graphs (a graph per row count) give the tokens of an engine
    that never speculates, greedy and seeded."""
    cfg = dict(dtype="bfloat16", quant="mxfp8", max_model_len=256, max_num_seqs=4, kv_cache_tokens=4096)
    plain = NativeEngine(str(tiny_hermes), EngineConfig(**cfg))
    spec = NativeEngine(str(tiny_hermes), EngineConfig(speculative="suffix", speculative_adaptive=False, **cfg))
    try:
        g = torch.Generator().manual_seed(5)
        base = torch.randint(3, 1000, (12,), generator=g).tolist()
        ps = [base * 4, base[3:] * 3]
        for params in (SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, temperature=0.8,
                                                                                      seed=2)):
            want, got = run_all(plain, ps, params), run_all(spec, ps, params)
            assert [[t.id for t in s] for s in got] == [[t.id for t in s] for s in want]
        assert spec.runner.static.replays > 0 and spec.spec.drafted > 0
    finally:
        asyncio.run(plain.stop())
        asyncio.run(spec.stop())


def test_float32_with_the_cpu_kernels_verifies_with_the_plain_tokens():
    """float32 on a CPU decodes through the C++ kernels where built (every layer in one call): there the
    draft's rows are decode rows reading the cache pages in place, each up to itself."""
    cfg = dict(dtype="float32", max_num_seqs=8)
    plain = NativeEngine(str(BUILTIN_DIR), EngineConfig(**cfg))
    spec = NativeEngine(str(BUILTIN_DIR), EngineConfig(speculative="suffix", speculative_adaptive=False, **cfg))
    try:
        params = SamplingParams(max_tokens=50, temperature=0.0, logprobs=True)
        want, got = run_all(plain, prompts(), params), run_all(spec, prompts(), params)
        assert [[t.id for t in s] for s in got] == [[t.id for t in s] for s in want]
        for gs, ws in zip(got, want, strict=True):
            assert [t.logprob for t in gs] == pytest.approx([t.logprob for t in ws], abs=1e-4)
        assert spec.spec.accepted > 0
    finally:
        asyncio.run(plain.stop())
        asyncio.run(spec.stop())


def test_float64_with_its_cpu_kernels_verifies_with_the_torch_paths_tokens():
    """The built-in model as served (float64) takes the float64 C++ kernels where built (few-query attention
    and the experts' few rows), for its batch-1 decodes and its drafts' rows alike: the same greedy tokens
    and log-probs (1e-9) as the torch paths without speculation."""
    from kernels import cpu_ext

    if cpu_ext.load(build_in_background=False) is None:
        pytest.skip("our CPU kernels are not built on this machine (tests/kernels builds them)")
    torch_paths = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8, cpu_kernels=False))
    kernel = NativeEngine(str(BUILTIN_DIR), EngineConfig(dtype="float64", max_num_seqs=8, speculative="suffix",
                                                         speculative_adaptive=False))
    try:
        assert "attention: float64 CPU kernel" in kernel.describe() and "CPU kernel" not in torch_paths.describe()
        assert "experts' decode rows in the float64 CPU kernel" in kernel.describe()
        params = SamplingParams(max_tokens=50, temperature=0.0, logprobs=True)
        ps = prompts()[1:3]  # one at a time: batch-1 steps, the kernel's
        want = [run_all(torch_paths, [p], params)[0] for p in ps]
        got = [run_all(kernel, [p], params)[0] for p in ps]
        assert [[t.id for t in s] for s in got] == [[t.id for t in s] for s in want]
        for gs, ws in zip(got, want, strict=True):
            assert [t.logprob for t in gs] == pytest.approx([t.logprob for t in ws], abs=1e-9)
        assert kernel.spec.accepted > 0
    finally:
        asyncio.run(torch_paths.stop())
        asyncio.run(kernel.stop())
