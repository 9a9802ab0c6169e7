"""The float64 C++ kernels (now: few-query attention and the experts' few rows) against the torch paths
(before) on the replayed agent traffic of bench/spec.py: two engines in one process, each request decoded by
one and then the other (the order alternating), decode-only tokens/s summed over the set, greedy outputs
checked identical; without speculation and with suffix speculation (each warmed on the next set, as
bench/spec_ab.py). Issue 50 (BENCHMARKS, speculative decoding). Usage: python bench/serve-results/f64_kernels_replay.py SET [off|suffix]."""

# ruff: noqa: E402 (the repository root goes on sys.path first)
import asyncio
import os
import sys
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"  # as bench/spec_ab.py: one torch thread
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import torch

torch.set_num_threads(1)
from bench.spec import SETS, WARM_REQUESTS, WARM_TOKENS, load_set, replay
from serve.chat_format import ChatFormat
from serve.cli import BUILTIN_DIR
from serve.engine.native import EngineConfig, NativeEngine
from serve.model.config import ModelConfig

name, method = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "off")
model_dir = str(BUILTIN_DIR)
chat = ChatFormat(model_dir)
max_len = ModelConfig.from_dir(model_dir).max_position_embeddings
sessions = ROOT / "bench" / "spec-results" / "sessions"
reqs = load_set(name, sessions, chat, max_len, None)
warm = load_set(SETS[(SETS.index(name) + 1) % len(SETS)], sessions, chat, max_len, WARM_REQUESTS)
engines = {arm: NativeEngine(model_dir, EngineConfig(dtype="float64", max_num_seqs=8, speculative=method,
                                                     cpu_kernels=arm == "kernel")) for arm in ("torch", "kernel")}
assert engines["kernel"].runner.few_query_kernel is not None, "the CPU kernels are not built: python -m kernels.cpu_ext"
decode_s, tokens, ids = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0), {arm: {} for arm in engines}
try:
    for e in engines.values():
        asyncio.run(replay(e, warm, 0.0, 1, chat.stop_token_ids, WARM_TOKENS))
    for i, r in enumerate(reqs):
        for arm in ("torch", "kernel") if i % 2 else ("kernel", "torch"):
            out = asyncio.run(replay(engines[arm], [r], 0.0, 1, chat.stop_token_ids))[0][0]
            ids[arm][r.id] = out["ids"]
            if out["tokens"] > 1:
                decode_s[arm] += out["time_s"] - out["ttft_s"]
                tokens[arm] += out["tokens"] - 1
finally:
    for e in engines.values():
        asyncio.run(e.stop())
rate = {arm: tokens[arm] / decode_s[arm] for arm in engines}
differ = sum(ids["torch"][k] != ids["kernel"][k] for k in ids["torch"])
print(f"{name}, speculation {method}, batch 1, {len(reqs)} requests: decode tok/s torch paths {rate['torch']:.1f}, "
      f"kernel {rate['kernel']:.1f}: {rate['kernel'] / rate['torch']:.3f}x; greedy outputs differing: {differ}")
sys.exit(1 if differ else 0)
