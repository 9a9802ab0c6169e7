"""The native engine against transformers, and against itself under batching, chunking, caching, pressure."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from serve.engine.base import SamplingParams
from serve.engine.native import EngineConfig, NativeEngine
from serve.engine.parity import forced_logits
from serve.model.config import ModelConfig
from serve.model.layers import rope_inv_freq
from serve.model.loader import load_model, save_mxfp8_experts
from serve.tiny import TinySpec, build_tiny_checkpoint


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[2], **kw)


def generate_all(engine: NativeEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    async def one(p):
        return [t.id async for t in engine.generate(p, params)]

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(main())


def routed(engine: NativeEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each request's routed experts [T, M, K] (greedy, 20 tokens), as the API returns them."""
    async def one(p):
        return [t async for t in engine.generate(p, greedy(20, return_routed_experts=True))][-1].routed_experts

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(main())


def prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def hf_logits(path, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # transformers' default grouped-matmul experts take no float64; its eager loop does
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def variants(tiny_hermes, tmp_path_factory):
    """Checkpoints that exercise the config's options: a dense layer and tied embeddings; YaRN; shards."""
    root = tmp_path_factory.mktemp("variants")
    dense = build_tiny_checkpoint(root / "dense-tied", tokenizer_from=tiny_hermes, seed=3, spec=TinySpec(
        num_hidden_layers=3, mlp_only_layers=[1], tie_word_embeddings=True, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=False))
    yarn = build_tiny_checkpoint(root / "yarn", tokenizer_from=tiny_hermes, seed=4, rope={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    sharded = build_tiny_checkpoint(root / "sharded", tokenizer_from=tiny_hermes, seed=5, max_shard_size="300KB")
    return {"base": tiny_hermes, "dense": dense, "yarn": yarn, "sharded": sharded}


@pytest.mark.parametrize("name", ["base", "dense", "yarn", "sharded"])
def test_fp32_logits_match_transformers(variants, name):
    path = variants[name]
    if name == "sharded":
        assert (path / "model.safetensors.index.json").exists()
    engine = NativeEngine(str(path), EngineConfig(dtype="float32", kv_cache_tokens=2048, block_size=8))
    ids = prompts(1, seed=11, lo=90, hi=91)[0]
    ref = hf_logits(path, ids)[60 - 1:]
    got = forced_logits(engine, ids, split=60)
    assert (got - ref).abs().max().item() <= 1e-4


def test_fp64_logits_match_transformers_to_float32_rounding(variants):
    """float64 (the built-in model's dtype, so that greedy output is the same on every CPU) runs in float64
    end to end (torch's paths, and the float64 few-query attention kernel where built; none of the float32
    C++ kernels): logits agree with transformers' to the float32 rounding they are returned in, where
    float32 serving is only within 1e-4."""
    path = variants["base"]
    engine = NativeEngine(str(path), EngineConfig(dtype="float64", kv_cache_tokens=2048, block_size=8))
    assert engine.runner.cpu_kernels is None and "torch.float64" in engine.describe()
    assert "decode attention: paged CPU kernel" not in engine.describe()
    ids = prompts(1, seed=11, lo=90, hi=91)[0]
    ref = hf_logits(path, ids, torch.float64)[60 - 1:]
    got = forced_logits(engine, ids, split=60)
    assert got.dtype == torch.float32
    assert (got.double() - ref).abs().max().item() <= 1e-6 * max(1.0, ref.abs().max().item())


def test_yarn_frequencies_equal_transformers(variants):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(variants["yarn"]), "cpu")
    inv, scale = rope_inv_freq(ModelConfig.from_dir(variants["yarn"]))
    assert torch.equal(inv, hf_inv.float()) and scale == pytest.approx(hf_scale)


@pytest.fixture(scope="module")
def engine(tiny_hermes):
    return NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=8192))


def test_greedy_generation_equals_transformers_generate(engine, tiny_hermes):
    model = AutoModelForCausalLM.from_pretrained(tiny_hermes, dtype=torch.float32)
    for p in prompts(3, seed=2):
        out = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=2,
                             pad_token_id=0)[0, len(p):].tolist()
        (got,) = generate_all(engine, [p], greedy(16))
        assert got == out


def test_stop_returns_once_the_engine_thread_has_ended(tiny_hermes):
    """A process that exits right after `stop` must not tear torch down under a step still running (it
    aborted at exit now and then): stop waits for the thread, also with a request in flight."""
    eng = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=2048))

    async def main():
        async def consume():
            try:
                async for _ in eng.generate(prompts(1, seed=9)[0], SamplingParams(max_tokens=200)):
                    pass
            except Exception:  # noqa: BLE001 - ended by the stop: what matters is the thread below
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        await eng.stop()
        assert not eng._thread.is_alive()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_batched_equals_unbatched(engine):
    ps = prompts(8, seed=3)
    alone = [generate_all(engine, [p], greedy())[0] for p in ps]
    together = generate_all(engine, ps, greedy())
    assert together == alone


def test_cpu_packed_weights_give_the_same_tokens_and_logits(tiny_hermes, engine):
    assert "packed for oneDNN" in engine.describe()  # the default on a CPU
    plain = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=8192, cpu_pack=False))
    assert "packed" not in plain.describe()
    assert plain.model.weight_bytes() == engine.model.weight_bytes()
    every = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=8192, cpu_pack=False))
    # 2 layers x (fused qkv, o, router), lm_head
    assert every.model.pack_for_cpu(min_linear_elements=0).startswith("q/k/v fused, 7 linear layers packed")
    ps = prompts(8, seed=12)
    want = generate_all(plain, ps, greedy())
    assert generate_all(engine, ps, greedy()) == want
    assert generate_all(every, ps, greedy()) == want
    ids = prompts(1, seed=13, lo=70, hi=71)[0]
    ref = forced_logits(plain, ids, split=50)
    for packed in (engine, every):
        assert (forced_logits(packed, ids, split=50) - ref).abs().max().item() <= 1e-4


def test_cpu_kernels_give_the_same_tokens_and_logits(tiny_hermes, engine):
    from kernels import cpu_ext

    if cpu_ext.load(build_in_background=False) is None:
        pytest.skip("our CPU kernels are not built on this machine (tests/kernels builds them)")
    assert "decode attention: paged CPU kernel" in engine.describe()
    assert "experts blocked for the CPU kernel" in engine.describe()
    gathered = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=8192, cpu_kernels=False))
    assert gathered.runner.cpu_kernels is None and "CPU kernel" not in gathered.describe()
    ps = prompts(8, seed=15)
    assert generate_all(engine, ps, greedy(20)) == generate_all(gathered, ps, greedy(20))
    ids = prompts(1, seed=16, lo=70, hi=71)[0]
    diff = forced_logits(engine, ids, split=20) - forced_logits(gathered, ids, split=20)
    assert diff.abs().max().item() <= 1e-4


def test_decode_steps_in_one_kernel_call_match_the_python_layers_to_the_bit(tiny_hermes):
    from kernels import cpu_ext

    if cpu_ext.load(build_in_background=False) is None:
        pytest.skip("our CPU kernels are not built on this machine (tests/kernels builds them)")
    fused, layered = (NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=8192))
                      for _ in range(2))
    assert "decode steps: every layer in one C++ call" in fused.describe()  # what the engine's decode steps take
    layered.model.fused_decode = False
    assert "one C++ call" not in layered.describe()
    ps = prompts(6, seed=17)
    assert generate_all(fused, ps, greedy(20)) == generate_all(layered, ps, greedy(20))
    ids = prompts(1, seed=18, lo=40, hi=41)[0]
    assert torch.equal(forced_logits(fused, ids, split=10), forced_logits(layered, ids, split=10))
    used = fused.runner.routes[:, 0, 0] >= 0
    # routing replay: the same experts recorded for every token of every request. Compared per request, not
    # per cache slot: which slots a request gets depends on when the engine thread saw it arrive
    assert used.any() and all(torch.equal(a, b) for a, b in zip(routed(fused, ps), routed(layered, ps), strict=True))


def test_a_request_joins_a_running_batch(engine):
    long_p, late_p = prompts(2, seed=14)
    alone = [generate_all(engine, [p], SamplingParams(max_tokens=n, temperature=0.0))[0]
             for p, n in ((long_p, 60), (late_p, 10))]

    async def main():
        order: list[str] = []

        async def run(name, p, n, start_after=None):
            if start_after is not None:
                await start_after.wait()
            out = []
            async for t in engine.generate(p, SamplingParams(max_tokens=n, temperature=0.0)):
                out.append(t.id)
                order.append(name)
                if name == "long" and len(out) == 5:
                    started.set()
            return out

        started = asyncio.Event()
        outs = await asyncio.gather(run("long", long_p, 60), run("late", late_p, 10, started))
        return outs, order

    outs, order = asyncio.run(main())
    assert outs == alone
    # The late request finished while the long one was still decoding: it joined, it did not wait.
    assert order.index("late") > order.index("long") and "long" in order[len(order) - order[::-1].index("late"):]


def test_chunked_prefill_equals_one_shot(tiny_hermes, engine):
    chunked = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=8192,
                                                          max_batched_tokens=32, prefix_caching=False))
    ps = prompts(4, seed=4, lo=100, hi=200)
    assert generate_all(chunked, ps, greedy()) == generate_all(engine, ps, greedy())


def test_prefix_cache_hits_give_the_same_tokens(tiny_hermes):
    cached = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=8192, block_size=8))
    plain = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=8192, block_size=8,
                                                        prefix_caching=False))
    turn1 = prompts(1, seed=5, lo=120, hi=121)[0]
    out1 = generate_all(cached, [turn1], greedy())[0]
    turn2 = turn1 + out1 + prompts(1, seed=6, lo=30, hi=31)[0]  # an agent's next request
    hits_before = cached.blocks.hit_tokens
    got = generate_all(cached, [turn2], greedy())[0]
    assert cached.blocks.hit_tokens - hits_before >= 120 // 8 * 8
    assert got == generate_all(plain, [turn2], greedy())[0]
    assert plain.blocks.hit_tokens == 0


def test_preemption_under_kv_pressure_keeps_outputs(tiny_hermes, engine):
    tight = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=256, block_size=8,
                                                        max_model_len=128, prefix_caching=False))
    assert len(tight.blocks.blocks) == 32  # room for about three of the six sequences at a time
    ps = prompts(6, seed=7, lo=40, hi=60)
    params = greedy(30)
    assert generate_all(tight, ps, params) == generate_all(engine, ps, params)
    assert tight.scheduler.preemptions > 0
    assert tight.blocks.num_free == len(tight.blocks.blocks)


def test_a_context_the_memory_cannot_hold_is_a_clear_error(tiny_hermes):
    with pytest.raises(ValueError, match="KV cache, more than this machine can spare.*--max-model-len"):
        NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", max_model_len=1 << 40))


def test_sampling_is_seeded_and_stops_on_stop_tokens(engine):
    p = prompts(1, seed=8)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=123)
    a, b = generate_all(engine, [p, p], params)
    assert a == b == generate_all(engine, [p], params)[0]
    first = a[0]
    stopped = generate_all(engine, [p], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50,
                                                        seed=123, stop_token_ids=[first]))[0]
    assert stopped == [first]


def test_cancelling_frees_the_blocks(engine):
    async def main():
        gen = engine.generate(prompts(1, seed=9)[0], greedy(500))
        got = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()
        return got

    assert len(asyncio.run(main())) == 3
    for _ in range(100):
        if not engine.scheduler.running:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert not engine.scheduler.running and engine.blocks.usage == 0.0


def test_mxfp8_experts_stay_close_to_full_precision(tiny_hermes, tmp_path):
    ids = prompts(1, seed=10, lo=64, hi=65)[0]
    full = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", kv_cache_tokens=1024))
    mx = NativeEngine(str(tiny_hermes), EngineConfig(dtype="float32", quant="mxfp8", kv_cache_tokens=1024))
    a, b = forced_logits(full, ids, 48), forced_logits(mx, ids, 48)
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 < rel < 0.05, rel  # stated tolerance: 5% relative L2 on the logits
    dense, experts = mx.model.weight_bytes()
    assert experts * 3.5 < full.model.weight_bytes()[1]  # fp8 + E8M0 scales vs fp32
    # In bfloat16, the served precision on a GPU: MXFP8 experts against bf16 experts, same tolerance.
    bf = NativeEngine(str(tiny_hermes), EngineConfig(dtype="bfloat16", kv_cache_tokens=1024))
    mx_bf = NativeEngine(str(tiny_hermes), EngineConfig(dtype="bfloat16", quant="mxfp8", kv_cache_tokens=1024))
    ref, got = forced_logits(bf, ids, 48), forced_logits(mx_bf, ids, 48)
    assert 0 < ((got - ref).norm() / ref.norm()).item() < 0.05

    # A checkpoint that stores MXFP8 experts (as train/ saves them) loads as is: same logits.
    import shutil

    stored = tmp_path / "mx-stored"
    shutil.copytree(tiny_hermes, stored)
    model = load_model(tiny_hermes, dtype=torch.float32, quant="mxfp8")
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(tiny_hermes / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if ".mlp.experts." not in k:
                tensors[k] = f.get_tensor(k)
    tensors.update(save_mxfp8_experts(model))
    save_file(tensors, str(stored / "model.safetensors"))
    again = NativeEngine(str(stored), EngineConfig(dtype="float32", kv_cache_tokens=1024))
    assert again.quant == "none"  # nothing to convert: the experts already are MXFP8
    assert torch.equal(forced_logits(again, ids, 48), b)
