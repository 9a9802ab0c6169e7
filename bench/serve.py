"""Serving speed, measured over HTTP: native engine vs the transformers reference, side by side.

    python bench/serve.py [--tokens 48] [--concurrency 1 8 32] [--repeat 3] [--model DIR]

Builds (once, cached under /tmp) a random Qwen3-MoE checkpoint large enough that matmuls dominate
(~300 MB in fp32: hidden 768, 4 layers, 16 experts top-4), starts `composer-serve` on it with both
engines (they take turns, --repeat times, medians reported), and streams /v1/completions requests with random token-id prompts (`ignore_eos`, so
every request generates exactly --tokens tokens):
  - decode throughput (generated tokens / wall time, all requests together) and mean time to first
    token at each concurrency;
  - an agent-shaped trace on the native engine: 10 turns, each prompt = previous prompt + the reply +
    a 200-token tool output; time to first token per turn with the prefix cache on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this file is named like the package it measures: the package must win
DEFAULT_CKPT = Path("/tmp/composer-bench-moe-300m")


def build_checkpoint(path: Path) -> Path:
    from serve.tiny import TinySpec, build_tiny_checkpoint

    if (path / "config.json").exists():
        return path
    spec = TinySpec(vocab_size=4096, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384,
                    num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                    num_experts=16, num_experts_per_tok=4, max_position_embeddings=16384)
    return build_tiny_checkpoint(path, spec=spec, seed=0)


def start(model: Path, *args: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "--model", str(model), "--port", "0",
                             "--served-model-name", "bench", "--dtype", "float32", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        m = re.search(r"serving .* at (http://\S+/v1) \((.*)\)", line)
        if m:
            import threading

            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError("composer-serve did not start")


async def one_request(client: httpx.AsyncClient, base: str, prompt: list[int], tokens: int) -> tuple[float, int]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    first, n = None, 0
    async with client.stream("POST", f"{base}/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            got = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
            if got and first is None:
                first = time.perf_counter() - start
            n += got
    return first or 0.0, n


async def load(base: str, concurrency: int, tokens: int, prompt_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 4000) for _ in range(prompt_len)] for _ in range(concurrency)]
    async with httpx.AsyncClient(timeout=None) as client:
        await one_request(client, base, prompts[0][:16], 2)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, base, p, tokens) for p in prompts))
        wall = time.perf_counter() - start
    generated = sum(n for _, n in results)
    return {"tok_s": generated / wall, "ttft": sum(t for t, _ in results) / len(results), "wall": wall,
            "generated": generated}


async def agent_trace(base: str, turns: int = 10, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 4000) for _ in range(1500)]
    ttfts = []
    async with httpx.AsyncClient(timeout=None) as client:
        for _ in range(turns):
            body = {"model": "bench", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            start = time.perf_counter()
            ttft, _ = await one_request(client, base, prompt, 1)
            ttfts.append(ttft)
            r = (await client.post(f"{base}/completions", json=body)).json()
            del start
            prompt = prompt + r["choices"][0]["token_ids"] + [rng.randrange(10, 4000) for _ in range(200)]
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=DEFAULT_CKPT)
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeat", type=int, default=3, help="alternating runs per engine and concurrency")
    ap.add_argument("--skip-trace", action="store_true")
    args = ap.parse_args()
    import torch

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    model = build_checkpoint(args.model)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 2**20
    print(f"checkpoint: {model} ({size:.0f} MiB safetensors, fp32)\n")
    # Both servers stay up and take turns, --repeat times per concurrency, so that a shared machine's
    # drifting speed hits both engines alike; the figures are medians.
    servers = {engine: start(model, "--engine", engine) for engine in ("native", "hf")}
    runs: dict[str, dict[int, list[dict]]] = {e: {c: [] for c in args.concurrency} for e in servers}
    try:
        for c in args.concurrency:
            for _ in range(args.repeat):
                for engine, (_, base) in servers.items():
                    runs[engine][c].append(asyncio.run(load(base, c, args.tokens, args.prompt_len, seed=c)))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    rows = {e: {c: {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "ttft")} for c, rs in by_c.items()}
            for e, by_c in runs.items()}
    print(f"## decode throughput, {args.tokens} tokens per request, {args.prompt_len}-token prompts "
          f"(median of {args.repeat} alternating runs)")
    print(f"{'concurrency':>11} {'native tok/s':>13} {'hf tok/s':>9} {'ratio':>6} {'native TTFT':>12} {'hf TTFT':>8}"
          f"  {'ratio per run':>14}")
    for c in args.concurrency:
        n, h = rows["native"][c], rows["hf"][c]
        each = " ".join(f"{a['tok_s'] / b['tok_s']:.2f}" for a, b in zip(runs["native"][c], runs["hf"][c], strict=True))
        print(f"{c:>11} {n['tok_s']:>13.1f} {h['tok_s']:>9.1f} {n['tok_s'] / h['tok_s']:>5.2f}x "
              f"{n['ttft'] * 1e3:>10.0f}ms {h['ttft'] * 1e3:>6.0f}ms  {each}")
    if args.skip_trace:
        return
    trace = {}
    for label, extra in (("prefix cache", []), ("no prefix cache", ["--no-prefix-caching"])):
        proc, base = start(model, "--engine", "native", *extra)
        try:
            trace[label] = asyncio.run(agent_trace(base))
        finally:
            proc.terminate()
            proc.wait()
    print("\n## agent-shaped trace (native): 10 turns, prompt = previous + 32-token reply + 200-token tool output")
    print(f"{'turn':>4} {'prompt tokens':>13} {'TTFT cached':>12} {'TTFT uncached':>14}")
    for i, (a, b) in enumerate(zip(trace["prefix cache"], trace["no prefix cache"], strict=True)):
        print(f"{i + 1:>4} {1500 + i * 232:>13} {a * 1e3:>10.0f}ms {b * 1e3:>12.0f}ms")
    ca, cb = sum(trace["prefix cache"][1:]), sum(trace["no prefix cache"][1:])
    print(f"turns 2-10 total TTFT: {ca * 1e3:.0f} ms with the prefix cache vs {cb * 1e3:.0f} ms without "
          f"({cb / ca:.1f}x)")


if __name__ == "__main__":
    main()
