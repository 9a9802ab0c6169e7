"""Serving speed on a CPU: the native engine over HTTP against transformers' own static batch.

    python bench/serve.py [--shapes e32 e16] [--tokens 64] [--concurrency 1 8 32] [--repeat 3]
                          [--dtype float32|bfloat16] [--stream-interval N] [--json /tmp/composer-bench-serve.json]
                          [--skip-trace] [--skip-profile]

For each shape, a random Qwen3-MoE checkpoint is built once under /tmp (e32: ~110 M parameters, hidden
512, 8 layers, 32 experts top-4, moe_intermediate 256; e16: the earlier benchmark's ~70 M, hidden 768,
4 layers, 16 experts top-4, moe_intermediate 384), saved in float32 and run by every contender in
--dtype (float32 by default: greedy outputs then match transformers'). Three contenders stay up at once
and take turns, --repeat times per concurrency (medians reported), so a shared machine's drift hits
them alike:
  - native: `composer-serve --engine native`, C streamed /v1/completions requests over HTTP at once;
  - static: transformers' `generate` on a left-padded batch of C prompts (same tokens, greedy,
    `min_new_tokens` = `max_new_tokens` = --tokens), in a worker process, no HTTP: what a user would
    compare a server with. It runs once per --static-experts implementation (default: transformers'
    own default grouped_mm, and eager), and each run compares with the fastest of them;
  - hf: `composer-serve --engine hf` (one request at a time), a secondary row at --hf-concurrency.
Every request generates exactly --tokens tokens (`ignore_eos`) from a --prompt-len random prompt.
Each run is followed by the same contenders on other fresh prompts with 1 new token (the prefill alone),
which splits each wall time into prefill and decode steps: where the time goes, the decode ratio, and the
native decode step that 2x the static batch would need given the prefill as measured.

Then, unless skipped: a per-step profile of the native model (decode steps at batch 8 and 32 on one
thread: the engine's step, all layers in one C++ call; the same step layer by layer in Python, split into
ms in the experts, in attention, in the rest; the torch paths), and the agent-shaped trace of the prefix cache
(10 turns, each prompt = the previous prompt + a 32-token reply + a 200-token tool output; TTFT with
the cache on and off, per turn the median of 3 conversations) on the first shape. Prints tables; writes
JSON and a PNG next to it.
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
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this file is named like the package it measures: the package must win
# every contender's environment: --threads sets OMP_NUM_THREADS; the OpenMP wait policy is composer-serve's
# default (serve/cli.py: passive, threads sleep between parallel regions) for the static batch too, so that
# both sides run under the same policy (--omp-wait active: libgomp's spinning, for both)
CHILD_ENV: dict[str, str] = {}
DTYPE = "float32"  # --dtype: every contender's

SHAPES = {
    "e32": ("/tmp/composer-bench-moe-e32", dict(vocab_size=4096, hidden_size=512, intermediate_size=1536,
                                                moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
                                                num_key_value_heads=4, head_dim=64, num_experts=32,
                                                num_experts_per_tok=4, max_position_embeddings=16384)),
    "e16": ("/tmp/composer-bench-moe-300m", dict(vocab_size=4096, hidden_size=768, intermediate_size=2048,
                                                 moe_intermediate_size=384, num_hidden_layers=4, num_attention_heads=12,
                                                 num_key_value_heads=4, head_dim=64, num_experts=16,
                                                 num_experts_per_tok=4, max_position_embeddings=16384)),
}


def build_checkpoint(shape: str) -> Path:
    from serve.tiny import TinySpec, build_tiny_checkpoint

    path, spec = SHAPES[shape]
    path = Path(path)
    if not (path / "config.json").exists():
        build_tiny_checkpoint(path, spec=TinySpec(**spec), seed=0)
    return path


def prompts_for(concurrency: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(prompt_len)] for _ in range(concurrency)]


# -- the contenders --------------------------------------------------------------------------------


def start_server(model: Path, *args: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **CHILD_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "--model", str(model), "--port", "0",
                             "--served-model-name", "bench", "--dtype", DTYPE, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        m = re.search(r"serving .* at (http://\S+/v1) \((.*)\)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            base = m.group(1)
            for _ in range(600):  # the line can come before the socket accepts: wait for /health
                try:
                    if httpx.get(base.removesuffix("/v1") + "/health", timeout=5).status_code == 200:
                        return proc, base
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            break
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


async def http_load(base: str, concurrency: int, tokens: int, prompt_len: int, seed: int) -> dict:
    prompts = prompts_for(concurrency, prompt_len, seed)
    async with httpx.AsyncClient(timeout=None) as client:
        await one_request(client, base, [3] * 16, 2)  # warm-up (a prompt no run shares a prefix with)
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, base, p, tokens) for p in prompts))
        wall = time.perf_counter() - start
    generated = sum(n for _, n in results)
    return {"tok_s": generated / wall, "ttft": sum(t for t, _ in results) / len(results), "wall": wall,
            "generated": generated}


class StaticBatch:
    """transformers' generate on a static batch, in a worker process (this file with --static-worker)."""

    def __init__(self, model: Path, experts: str, dtype: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT), **CHILD_ENV}
        self.proc = subprocess.Popen([sys.executable, __file__, "--static-worker", str(model), experts, dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the static-batch worker did not start")

    def run(self, concurrency: int, tokens: int, prompt_len: int, seed: int) -> dict:
        self.proc.stdin.write(json.dumps({"c": concurrency, "tokens": tokens, "prompt_len": prompt_len,
                                          "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def static_worker(model: str, experts: str, dtype: str) -> None:
    """Loads, warms up, then answers one JSON line per batch on stdout (all torch on this one thread)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), experts_implementation=experts).eval()

    def generate(prompts: list[list[int]], tokens: int):
        width = max(map(len, prompts))  # left padding: every prompt ends where generation starts
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            return m.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, pad_token_id=0)

    generate(prompts_for(1, 16, 0), 2)
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        prompts = prompts_for(job["c"], job["prompt_len"], job["seed"])
        start = time.perf_counter()
        out = generate(prompts, job["tokens"])
        wall = time.perf_counter() - start
        generated = (out.shape[1] - len(prompts[0])) * len(prompts)
        print(json.dumps({"tok_s": generated / wall, "ttft": None, "wall": wall, "generated": generated}),
              flush=True)


# -- the profile -------------------------------------------------------------------------------------


def step_profile(model_dir: Path, batches: list[int], prompt_len: int, steps: int = 16, rounds: int = 2,
                 dtype: str = "float32") -> dict:
    """ms per decode step at each batch size, split into experts (router + expert matmuls), attention
    (projections, rope, cache writes, attention itself) and the rest (embedding, norms, residuals,
    lm_head, the runner's bookkeeping, argmax). Timed by wrapping the modules' forwards (a CPU runs ops
    synchronously, so wall time inside a forward is its cost). In-process, load and steps on one thread.

    Three variants, alternating `rounds` times (the best round of each is kept): "now" (what the engine
    runs: every layer of a decode step in one C++ call, so no split), "layers" (the same kernels, each
    layer's Python forward: the split), and "before" (decode attention gathering pages with torch, expert
    weights in their checkpoint layout, experts through torch's grouped path), side by side."""
    import torch

    import serve.model.qwen3_moe as q
    from serve.engine.base import SamplingParams
    from serve.engine.block_manager import BlockManager
    from serve.engine.model_runner import ModelRunner
    from serve.engine.sequence import Sequence
    from serve.model.loader import load_model

    spent = {"experts": 0.0, "attention": 0.0}
    originals = {q.SparseMoE: q.SparseMoE.forward, q.Attention: q.Attention.forward}

    def timed(fn, key):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start
        return wrapper

    def one(model, B: int, kernels) -> dict:
        blocks = B * (-(-(prompt_len + steps + 8) // 16)) + 1
        bm = BlockManager(blocks, 16, False)
        runner = ModelRunner(model, blocks, 16, torch.device("cpu"), getattr(torch, dtype), kernels)
        rng = random.Random(B)
        seqs = [Sequence([rng.randrange(10, 4000) for _ in range(prompt_len)], SamplingParams(max_tokens=steps))
                for _ in range(B)]
        for s in seqs:
            bm.allocate(s)
        runner.run([(s, prompt_len) for s in seqs])
        times = []
        for i in range(steps + 4):
            for s in seqs:
                s.num_computed = len(s)
                s.token_ids.append(rng.randrange(10, 4000))
                bm.ensure(s, len(s))
            if i == 4:  # warm-up over
                spent.update(experts=0.0, attention=0.0)
            start = time.perf_counter()
            _, logits = runner.run([(s, 1) for s in seqs])
            logits.argmax(-1)
            if i >= 4:
                times.append(time.perf_counter() - start)
        total = sum(times) / len(times) * 1e3
        e, a = spent["experts"] / len(times) * 1e3, spent["attention"] / len(times) * 1e3
        if model.decode_plan(kernels) is not None:
            e = a = None  # the layers ran in one C++ call: no split (the "layers" variant has it)
        return {"step_ms": total, "experts_ms": e, "attention_ms": a, "rest_ms": None if e is None else total - e - a,
                "tok_s": B / (total / 1e3), "cpu_kernels": runner.cpu_kernels is not None}

    q.SparseMoE.forward = timed(originals[q.SparseMoE], "experts")
    q.Attention.forward = timed(originals[q.Attention], "attention")
    try:
        from kernels import cpu_ext

        kernels = cpu_ext.load(build_in_background=False)
        now = load_model(model_dir, dtype=getattr(torch, dtype))
        now.pack_for_cpu(cpu_kernels=kernels)
        before = load_model(model_dir, dtype=getattr(torch, dtype))
        before.pack_for_cpu()
        for moe in before.moe_layers():  # back to the checkpoint's [E, N, D] row-major layout
            moe.w13, moe.w2 = moe.w13.contiguous(), moe.w2.contiguous()
        out: dict = {"now": {}, "layers": {}, "before": {}}
        for B in batches:
            for _ in range(rounds):
                for name, model, k in (("now", now, kernels), ("layers", now, kernels), ("before", before, None)):
                    model.fused_decode = name == "now"
                    r = one(model, B, k)
                    if B not in out[name] or r["step_ms"] < out[name][B]["step_ms"]:
                        out[name][B] = r
        return out
    finally:
        q.SparseMoE.forward, q.Attention.forward = originals[q.SparseMoE], originals[q.Attention]


# -- the prefix-cache trace -------------------------------------------------------------------------


async def agent_trace(base: str, turns: int = 10, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 4000) for _ in range(1500)]
    ttfts = []
    async with httpx.AsyncClient(timeout=None) as client:
        for _ in range(turns):
            body = {"model": "bench", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            ttft, _ = await one_request(client, base, prompt, 1)
            ttfts.append(ttft)
            r = (await client.post(f"{base}/completions", json=body)).json()
            prompt = prompt + r["choices"][0]["token_ids"] + [rng.randrange(10, 4000) for _ in range(200)]
    return ttfts


def trace(model: Path, conversations: int = 3) -> dict:
    """Each server (prefix cache on, off) runs `conversations` traces with different seeds, one after the
    other; each turn's TTFT is their median (a single trace was at the mercy of one slow turn)."""
    out, each = {}, {}
    for label, extra in (("cached", []), ("uncached", ["--no-prefix-caching"])):
        proc, base = start_server(model, "--engine", "native", *extra)
        try:
            each[label] = [asyncio.run(agent_trace(base, seed=seed)) for seed in range(1, conversations + 1)]
        finally:
            proc.terminate()
            proc.wait()
        out[label] = [statistics.median(turn) for turn in zip(*each[label], strict=True)]
    print(f"\n## agent-shaped trace (native): 10 turns, prompt = previous + 32-token reply + 200-token tool output "
          f"(median of {conversations} conversations)")
    print(f"{'turn':>4} {'prompt tokens':>13} {'TTFT cached':>12} {'TTFT uncached':>14}")
    for i, (a, b) in enumerate(zip(out["cached"], out["uncached"], strict=True)):
        print(f"{i + 1:>4} {1500 + i * 232:>13} {a * 1e3:>10.0f}ms {b * 1e3:>12.0f}ms")
    ca, cb = sum(out["cached"][1:]), sum(out["uncached"][1:])
    print(f"turns 2-10 total TTFT: {ca * 1e3:.0f} ms with the prefix cache vs {cb * 1e3:.0f} ms without ({cb / ca:.1f}x)")
    return out | {"conversations": each}


# -- the run ----------------------------------------------------------------------------------------


def measure_shape(shape: str, args) -> dict:
    model = build_checkpoint(shape)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 2**20
    print(f"\n# {shape}: {model} ({size:.0f} MiB safetensors, fp32), every contender in {DTYPE}", flush=True)
    servers = {"native": start_server(model, "--engine", "native", "--stream-interval", str(args.stream_interval))}
    if args.hf_concurrency:
        servers["hf"] = start_server(model, "--engine", "hf")
    # transformers' experts implementations (its default, grouped_mm, first): each run's static batch is the
    # fastest of them in that run, so the comparison is against the best a transformers user gets
    statics = {impl: StaticBatch(model, impl, DTYPE) for impl in args.static_experts}
    runs: dict[str, dict[int, list[dict]]] = {
        e: {c: [] for c in args.concurrency} for e in ("native", "static", "hf", *(f"static:{i}" for i in statics))
    }
    prefill: dict[str, dict[int, list[float]]] = {e: {c: [] for c in args.concurrency} for e in ("native", "static")}
    try:
        for c in args.concurrency:
            for r in range(args.repeat):
                # fresh prompts every run (the same for every contender): repeating a run's prompts would
                # let the native server's prefix cache skip their prefill, which the static batch cannot
                seed = 1000 * c + r
                runs["native"][c].append(asyncio.run(http_load(servers["native"][1], c, args.tokens,
                                                               args.prompt_len, seed=seed)))
                each = {i: st.run(c, args.tokens, args.prompt_len, seed=seed) for i, st in statics.items()}
                best = min(each, key=lambda i: each[i]["wall"])
                for i, res in each.items():
                    runs[f"static:{i}"][c].append(res)
                runs["static"][c].append(each[best] | {"experts": best})
                if c in args.hf_concurrency:
                    runs["hf"][c].append(asyncio.run(http_load(servers["hf"][1], c, args.tokens, args.prompt_len,
                                                               seed=seed)))
                # the same batch with one new token: the prefill alone (other fresh prompts), so the wall
                # splits into prefill and decode steps for both contenders
                prefill["native"][c].append(asyncio.run(http_load(servers["native"][1], c, 1, args.prompt_len,
                                                                   seed=seed + 500))["wall"])
                prefill["static"][c].append(statics[best].run(c, 1, args.prompt_len, seed=seed + 500)["wall"])
                n, s = runs["native"][c][-1], runs["static"][c][-1]
                others = ", ".join(f"{i} {res['tok_s']:.1f}" for i, res in each.items())
                print(f"  c={c} run {r + 1}: native {n['tok_s']:.1f} tok/s, static {s['tok_s']:.1f} tok/s "
                      f"({n['tok_s'] / s['tok_s']:.2f}x; static by experts implementation: {others}); "
                      f"prefill alone native {prefill['native'][c][-1]:.2f} s, static {prefill['static'][c][-1]:.2f} s",
                      flush=True)
    finally:
        for st in statics.values():
            st.close()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    table = {}
    print(f"\n## {shape}: decode throughput, {args.tokens} tokens per request from {args.prompt_len}-token prompts "
          f"(median of {args.repeat} alternating runs)")
    print(f"{'conc.':>5} {'native tok/s':>12} {'static tok/s':>12} {'vs static':>9} {'per run':>16} "
          f"{'hf-engine tok/s':>15} {'native TTFT':>11}")
    for c in args.concurrency:
        med = {e: statistics.median(r["tok_s"] for r in runs[e][c]) if runs[e][c] else None for e in runs}
        each = [a["tok_s"] / b["tok_s"] for a, b in zip(runs["native"][c], runs["static"][c], strict=True)]
        ttft = statistics.median(r["ttft"] for r in runs["native"][c])
        table[c] = {"native_tok_s": med["native"], "static_tok_s": med["static"], "hf_engine_tok_s": med["hf"],
                    "ratio_vs_static": statistics.median(each), "ratio_per_run": each, "native_ttft_s": ttft,
                    "static_tok_s_by_experts": {i: med[f"static:{i}"] for i in statics},
                    "static_experts_per_run": [r["experts"] for r in runs["static"][c]]}
        table[c].update(split(runs, prefill, c, args.tokens))
        hf = f"{med['hf']:.1f}" if med["hf"] else "-"
        print(f"{c:>5} {med['native']:>12.1f} {med['static']:>12.1f} {statistics.median(each):>8.2f}x "
              f"{' '.join(f'{x:.2f}' for x in each):>16} {hf:>15} {ttft * 1e3:>9.0f}ms")
    print(f"\n## {shape}: where the time goes (medians): prefill = the same batch with 1 new token; decode step = "
          f"(wall - prefill) / {args.tokens - 1}; 2x needs = the native decode step at which native would reach 2x")
    print(f"{'conc.':>5} {'prefill native':>14} {'static':>7} {'decode step native':>18} {'static':>7} "
          f"{'decode ratio':>12} {'2x needs':>9}")
    for c in args.concurrency:
        t = table[c]
        need = f"{t['step_ms_for_2x']:.1f} ms" if t["step_ms_for_2x"] > 0 else "impossible"
        print(f"{c:>5} {t['native_prefill_s']:>12.2f} s {t['static_prefill_s']:>5.2f} s {t['native_step_ms']:>15.1f} ms "
              f"{t['static_step_ms']:>4.1f} ms {t['decode_ratio']:>11.2f}x {need:>9}")
    return {"checkpoint": str(model), "mib": size, "table": table, "runs": runs, "prefill_s": prefill}


def split(runs: dict, prefill: dict, c: int, tokens: int) -> dict:
    """Median prefill time, per-step decode time and their ratio for each contender at concurrency c, and the
    native decode step that would give 2x the static batch with the native prefill as measured (<= 0: 2x
    cannot be reached by decoding faster)."""
    out = {}
    for e in ("native", "static"):
        pre = statistics.median(prefill[e][c])
        out[f"{e}_prefill_s"] = pre
        out[f"{e}_step_ms"] = statistics.median(r["wall"] - p for r, p in zip(runs[e][c], prefill[e][c],
                                                                               strict=True)) / (tokens - 1) * 1e3
    out["decode_ratio"] = out["static_step_ms"] / out["native_step_ms"]
    static_wall = statistics.median(r["wall"] for r in runs["static"][c])
    out["step_ms_for_2x"] = (static_wall / 2 - out["native_prefill_s"]) / (tokens - 1) * 1e3
    return out


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(results["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        table = results["shapes"][shape]["table"]
        cs = sorted(table, key=int)
        for key, label in (("native_tok_s", "native (HTTP)"), ("static_tok_s", "transformers static batch"),
                           ("hf_engine_tok_s", "--engine hf (HTTP)")):
            pts = [(int(c), table[c][key]) for c in cs if table[c][key]]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set(title=shape, xlabel="concurrency", ylabel="generated tok/s", xscale="log", xticks=[int(c) for c in cs])
        ax.set_xticklabels(cs)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--static-worker":
        return static_worker(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["e32", "e16"])
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeat", type=int, default=3, help="alternating runs per contender and concurrency")
    ap.add_argument("--hf-concurrency", type=int, nargs="*", default=[1, 8],
                    help="concurrencies for the --engine hf row (it serves one request at a time)")
    ap.add_argument("--static-experts", nargs="+", default=["grouped_mm", "eager"],
                    help="transformers' experts_implementation values for the static batch (default: its own "
                         "default grouped_mm, and eager); each run compares with the fastest of them")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="every contender's dtype (the checkpoint is float32): bfloat16 halves the expert bytes a "
                         "decode step streams, and is fast where the CPU has bf16 dot products (AVX512-BF16, AMX)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the native server's --stream-interval: tokens per streamed chunk after the first")
    ap.add_argument("--json", type=Path, default=Path("/tmp/composer-bench-serve.json"))
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of every contender (OMP_NUM_THREADS); default torch's own choice. On a "
                         "crowded machine 1 thread each keeps OpenMP barriers from waiting on descheduled threads")
    ap.add_argument("--omp-wait", choices=["passive", "active"], default="passive",
                    help="OMP_WAIT_POLICY of every contender (passive: composer-serve's default)")
    args = ap.parse_args()
    CHILD_ENV["OMP_WAIT_POLICY"] = args.omp_wait
    global DTYPE
    DTYPE = args.dtype
    if args.tokens < 2:
        ap.error("--tokens must be at least 2 (the decode step is measured against a 1-token run)")
    import torch

    if args.threads:
        CHILD_ENV["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)

    from kernels import cpu_ext
    from kernels.moe import measure_cpu_costs

    try:  # built once per machine; the servers started below then find it
        cpu_ext.build()
        print(f"CPU kernels: {cpu_ext.build_dir()}")
    except Exception as e:  # noqa: BLE001 - the engine falls back to torch's paths; say so
        print(f"CPU kernels: not available ({e}); the native engine runs the torch paths")

    flags = set()
    try:
        flags = set(next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")).split())
    except (OSError, StopIteration):
        pass
    bf16 = sorted(flags & {"amx_bf16", "avx512_bf16"})
    print(f"OpenMP wait policy of every contender: {args.omp_wait}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f}), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, bf16 matmul flags: {' '.join(bf16) or 'none (experts stay fp32)'}")
    costs = measure_cpu_costs()
    print(f"CPU costs now: {costs.bytes_per_s / 1e9:.1f} GB/s streamed by few-row matmuls, "
          f"{costs.flops_per_s / 1e9:.0f} GFLOP/s, {costs.op_s * 1e6:.0f} us per small op")
    results: dict = {"command": " ".join(sys.argv), "dtype": DTYPE, "omp_wait": args.omp_wait, "stream_interval": args.stream_interval, "threads": torch.get_num_threads(),
                     "load_average": os.getloadavg(), "machine": platform.machine(), "cores": os.cpu_count(),
                     "torch": torch.__version__, "bf16_flags": bf16, "cpu_costs": vars(costs),
                     "tokens": args.tokens, "prompt_len": args.prompt_len, "static_experts": args.static_experts,
                     "shapes": {}}
    for shape in args.shapes:
        results["shapes"][shape] = measure_shape(shape, args)
        args.json.write_text(json.dumps(results, indent=1))
    if not args.skip_profile:
        print("\n## per decode step, native model, one thread owning torch (ms)")
        print(f"{'shape':>5} {'batch':>5} {'step':>6} {'experts':>8} {'attention':>9} {'rest':>6} {'tok/s':>6}  variant "
              "(now: our CPU kernels, the layers in one C++ call; layers: the same kernels, each layer's "
              "Python forward; before: the torch paths)")

        def ms(v: float | None, width: int) -> str:
            return f"{'-':>{width}}" if v is None else f"{v:>{width}.1f}"

        for shape in args.shapes:
            prof = step_profile(build_checkpoint(shape), [8, 32], args.prompt_len, dtype=DTYPE)
            results["shapes"][shape]["profile"] = prof
            for variant, rows in prof.items():
                for B, p in rows.items():
                    print(f"{shape:>5} {B:>5} {p['step_ms']:>6.1f} {ms(p['experts_ms'], 8)} {ms(p['attention_ms'], 9)} "
                          f"{ms(p['rest_ms'], 6)} {p['tok_s']:>6.0f}  {variant}")
    if not args.skip_trace:
        results["trace"] = trace(build_checkpoint(args.shapes[0]))
    args.json.write_text(json.dumps(results, indent=1))
    plot(results, args.json.with_suffix(".png"))
    print(f"\nwrote {args.json} and {args.json.with_suffix('.png')}")


if __name__ == "__main__":
    main()
