"""Reliability probes against a real composer-serve on loopback: load, then clients that walk away.

    python bench/server_probes.py [--model DIR] [--streams 64] [--requests 3] [--abandoned 16] [--time-limit 120]

Starts `composer-serve` on 127.0.0.1 (a tiny random checkpoint, built once under /tmp, unless --model),
then:
  - load: --streams concurrent clients, each streaming --requests chat completions one after another
    (--max-tokens each); counts errors (a non-200, an error event, a stream without [DONE]) and
    measures time to first token (the first chunk: the server sends the role with the first token);
  - abandon: --abandoned clients that go away mid-answer (half streamed, closed after the first
    chunks; half not streamed, closed by a read timeout), each asking for 4000 tokens;
and after each, waits for the engine to be idle and prints running/waiting sequences and KV-cache use.
Bounded: a fixed number of requests, and --time-limit seconds for the whole run (then it stops and
says so). Exits 1 on any error or a server that does not go back to idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_CKPT = Path("/tmp/composer-probe-tiny")


def start(model: Path) -> tuple[subprocess.Popen, str, str]:
    """composer-serve on a free loopback port: (process, base URL, its start-up line)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "--model", str(model), "--host", "127.0.0.1",
                             "--port", "0", "--served-model-name", "probe", "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        m = re.search(r"serving .* at (http://127\.0\.0\.1:\d+/v1)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1), line.strip()
    raise RuntimeError("composer-serve did not start")


async def engine_state(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    text = (await client.get(base.removesuffix("/v1") + "/metrics")).text
    names = {"running": "composer_requests_running", "waiting": "composer_requests_waiting",
             "kv": "composer_kv_cache_usage_ratio"}
    return {k: float(re.search(rf"^{n} (\S+)$", text, re.M).group(1)) for k, n in names.items()}


async def until_idle(client: httpx.AsyncClient, base: str, timeout: float) -> tuple[float, dict[str, float]]:
    """Seconds until no sequence runs or waits and the KV cache is empty (or the timeout), and the state then."""
    start = time.monotonic()
    while True:
        state = await engine_state(client, base)
        if not any(state.values()) or time.monotonic() - start > timeout:
            return time.monotonic() - start, state


def body(i: int, max_tokens: int, stream: bool) -> dict:
    return {"model": "probe", "messages": [{"role": "user", "content": f"Probe {i}: write a long story."}],
            "max_tokens": max_tokens, "temperature": 0.8, "ignore_eos": True, "stream": stream}


async def one_stream(client: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> tuple[float | None, str]:
    """(time to first chunk, error or "")."""
    start, first = time.monotonic(), None
    try:
        async with client.stream("POST", f"{base}/chat/completions", json=body(i, max_tokens, True)) as r:
            if r.status_code != 200:
                return None, f"HTTP {r.status_code}"
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                if first is None:
                    first = time.monotonic() - start
                if "error" in json.loads(line[6:]):
                    return first, f"error event: {line[6:200]}"
            return first, "" if done else "stream ended without [DONE]"
    except httpx.HTTPError as e:
        return first, f"{type(e).__name__}: {e}"


async def load(base: str, streams: int, requests: int, max_tokens: int, deadline: float) -> dict:
    ttfts: list[float] = []
    errors: list[str] = []

    async def client_loop(client: httpx.AsyncClient, c: int) -> None:
        for k in range(requests):
            if time.monotonic() > deadline:
                errors.append("time limit reached")
                return
            ttft, err = await one_stream(client, base, c * requests + k, max_tokens)
            if ttft is not None:
                ttfts.append(ttft)
            if err:
                errors.append(err)

    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(client_loop(client, c) for c in range(streams)))
        wall = time.monotonic() - start
        idle_s, state = await until_idle(client, base, timeout=30)
    return {"wall": wall, "ttfts": ttfts, "errors": errors, "idle_s": idle_s, "state": state}


async def abandon(base: str, count: int) -> dict:
    errors: list[str] = []

    async def walk_away(i: int) -> None:
        stream = i % 2 == 0
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=None if stream else 1.0)) as client:
            try:
                if stream:
                    async with client.stream("POST", f"{base}/chat/completions", json=body(i, 4000, True)) as r:
                        async for n, _ in _enumerate(r.aiter_lines()):
                            if n > 4:
                                return  # closing the client drops the connection
                else:
                    await client.post(f"{base}/chat/completions", json=body(i, 4000, False))
                    errors.append("a 4000-token answer came back within the 1 s read timeout")
            except httpx.ReadTimeout:
                pass  # the walk-away itself
            except httpx.HTTPError as e:
                errors.append(f"{type(e).__name__}: {e}")

    async with httpx.AsyncClient(timeout=10) as client:
        peak = 0.0

        async def sample() -> None:  # how many were generating at once: the probe did reach the engine
            nonlocal peak
            while True:
                peak = max(peak, (await engine_state(client, base))["running"])
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(walk_away(i) for i in range(count)))
        sampler.cancel()
        idle_s, state = await until_idle(client, base, timeout=30)
    return {"errors": errors, "idle_s": idle_s, "state": state, "peak": peak}


async def _enumerate(lines):
    n = 0
    async for line in lines:
        yield n, line
        n += 1


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else 0.0)


def show_state(label: str, r: dict) -> str:
    s = r["state"]
    return (f"{label}: idle after {r['idle_s']:.1f} s: running {s['running']:.0f}, waiting {s['waiting']:.0f}, "
            f"KV usage {s['kv'] * 100:.1f}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: a tiny random one under /tmp)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3, help="streamed requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--abandoned", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=120, help="seconds for the load probe, at most")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from serve.tiny import build_tiny_checkpoint

        model = DEFAULT_CKPT if (DEFAULT_CKPT / "config.json").exists() else build_tiny_checkpoint(DEFAULT_CKPT)
    proc, base, line = start(model)
    print(line)
    try:
        r = asyncio.run(load(base, args.streams, args.requests, args.max_tokens, time.monotonic() + args.time_limit))
        t = r["ttfts"]
        print(f"load: {args.streams} streams x {args.requests} requests of {args.max_tokens} tokens in "
              f"{r['wall']:.1f} s: {len(r['errors'])} errors, TTFT p50 {pct(t, 50):.2f} s, p95 {pct(t, 95):.2f} s "
              f"({len(t)} measured)")
        for e in sorted(set(r["errors"]))[:5]:
            print(f"  error: {e}")
        print(show_state("after load", r))
        a = asyncio.run(abandon(base, args.abandoned))
        print(f"abandon: {args.abandoned} clients gone mid-answer ({(args.abandoned + 1) // 2} streamed, "
              f"{args.abandoned // 2} not; {a['peak']:.0f} generating at the peak), {len(a['errors'])} errors")
        for e in sorted(set(a["errors"]))[:5]:
            print(f"  error: {e}")
        print(show_state("after abandon", a))
    finally:
        proc.terminate()
        proc.wait(10)
    clean = not r["errors"] and not a["errors"] and not any(r["state"].values()) and not any(a["state"].values())
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
