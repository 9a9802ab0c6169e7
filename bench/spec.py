"""Speculative decoding on replayed agent traffic: the native engine with speculation off, ngram and suffix.

    python bench/spec.py [--quick] [--limit N] [--repeat 3] [--sets agent stdlib edit expert random] [--fixed]
                         [--sessions bench/spec-results/sessions] [--out bench/spec-results]

Sets (recorded once by bench/spec_record.py into --sessions, replayed from there; see its docstring):
  agent   the built-in model's own eval episodes on synthetic-small;
  stdlib  its episodes on bugs injected into real standard-library modules (it greps; no source read);
  edit    the edit-heavy set: bugs injected into real standard-library modules, a scripted read_file of
          the real source around each bug, then the model's own turns (edits, test runs, answers);
  expert  the scripted expert's edit episodes, as contexts: the served model writes its own completions;
  random  12 chat prompts of random lowercase words (~150 tokens): prompts that never repeat, though the
          built-in model answers them with its usual tool calls, which earlier requests' outputs predict;
  norepeat the same 12 prompts served by random weights of the built-in model's shape (load_format dummy):
          text that never repeats, prompt and output (no 3-gram of an output occurs twice, greedy or T=1),
          where speculation can only cost: what the drafter's look-ups and its probes cost is what it shows.
Each request's prompt ids are rendered as the server renders them (ChatFormat.render_ids of the exact
messages and tools sent), with max_tokens = min(256, the context room) and the chat format's stop tokens.

For each set x temperature (0: greedy; 1.0: a fixed seed per request) x concurrency (1, 8), the methods
off / ngram / suffix run back to back, in an order that turns each repeat (a shared machine drifts 2x
minute to minute: ratios are only read between neighbours; and the first run of a trio measured a few
percent slower whatever its method), each on a fresh engine (float64, the built-in model's serving dtype) warmed
first on a few requests of another set, so the suffix drafter's cross-request cache holds other text and
no measured output has been seen before. Each trio runs --repeat times; tokens/s are medians, and a
speedup is the median of each repeat's ratio to the off run beside it. Decode tokens/s = generated
tokens / wall seconds of the run (prefills included); stream decode tokens/s = tokens after each first
token / seconds after it, summed over requests (decoding alone); decode steps' tokens/s = the same
without the tokens a prefill's forward kept from a draft (the engine drafts a prompt's opening too and
verifies it in the prefill: those tokens arrive with the first, and are not the decode steps' work);
latency = the requests' summed time, off over the method's. A forward of a sequence yields exactly one token that is not an accepted draft, so tokens per forward =
tokens / (tokens - accepted). Checks: greedy ids identical to off on every request, logprobs within
1e-5 (exit 1 otherwise). Accepted share and tokens per forward are also split by the kind of text a
token falls in (tool call, reasoning, answer). Writes OUT/spec.json and OUT/spec.png (--fixed:
spec-fixed.json: the edit sets, greedy, batch 1, every proposal verified, no cost model), and every
request's tokens, logprobs and time (first repeat) in OUT/spec-requests.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETS = ("agent", "stdlib", "edit", "expert", "random", "norepeat")
RANDOM_WEIGHTS = ("norepeat",)  # sets served by random weights of the built-in model's shape
EDIT_SETS = ("stdlib", "edit", "expert")
METHODS = ("off", "ngram", "suffix")
MAX_TOKENS = 256
WARM_REQUESTS, WARM_TOKENS = 4, 48
LOGPROB_TOL = 1e-5
KIND_TAGS = (("tool", "<tool_call>", "</tool_call>"), ("tool", "<function=", "</function>"),
             ("reasoning", "<think>", "</think>"))


@dataclass
class Request:
    id: str
    ids: list[int]
    max_tokens: int
    in_reasoning: bool  # the rendered prompt ends with an open <think>: the completion starts inside it
    recorded_prompt_tokens: int | None = None  # what the server counted when the session was recorded


# -- the requests ---------------------------------------------------------------------------------------

def load_set(name: str, folder: Path, chat, max_model_len: int, limit: int | None) -> list[Request]:
    if name in ("random", "norepeat"):
        return random_prompts(chat, max_model_len, limit or 12)
    from agent.session import load

    out: list[Request] = []
    for path in sorted((folder / name).glob("*.jsonl")):
        data = load(path)
        tools = data.meta.get("tools") or None  # the agent sends tool_choice auto: the server renders them
        for i, (rec, messages) in enumerate(data.requests()):
            out.append(_request(f"{path.stem}#{i}", chat, messages, tools, max_model_len,
                                (rec.get("usage") or {}).get("prompt_tokens")))
    return out[:limit] if limit else out


def random_prompts(chat, max_model_len: int, n: int) -> list[Request]:
    """Chat prompts of random lowercase 'words', ~150 tokens each: nothing in them, or in what the model
    answers to them, occurs twice except by chance. Seeded: the same prompts every run."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        words: list[str] = []
        while len(chat.encode(" ".join(words))) < 150:
            words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
        out.append(_request(f"random#{i}", chat, [{"role": "user", "content": " ".join(words)}], None, max_model_len))
    return out


def _request(rid, chat, messages, tools, max_model_len, recorded=None) -> Request:
    text = chat.render(messages, tools, True)  # what serve/chat_api.prepare renders (prepare_messages inside)
    ids = chat.encode(text)
    return Request(rid, ids, min(MAX_TOKENS, max_model_len - len(ids)), text.rstrip().endswith("<think>"), recorded)


# -- one run ----------------------------------------------------------------------------------------------

def seed_of(rid: str) -> int:
    return zlib.crc32(rid.encode())  # the same per request for every method: seeded samples must agree


def first_forward(accepted: list[int]) -> int:
    """Tokens a request got from its first forward (its prefill): 1, plus the draft tokens that forward
    verified and kept (the leading run of accepted tokens)."""
    run = 0
    while run < len(accepted) and accepted[run]:
        run += 1
    return min(run + 1, len(accepted))


async def replay(engine, reqs: list[Request], temperature: float, concurrency: int, stops: list[int],
                 max_tokens: int | None = None) -> tuple[list[dict], float]:
    from serve.engine.base import SamplingParams

    sem = asyncio.Semaphore(concurrency)

    async def one(r: Request) -> dict:
        params = SamplingParams(max_tokens=min(r.max_tokens, max_tokens or r.max_tokens), temperature=temperature,
                                seed=seed_of(r.id) if temperature > 0 else None, stop_token_ids=stops, logprobs=True)
        async with sem:
            t0 = time.perf_counter()
            toks, ttft = [], 0.0
            async for t in engine.generate(r.ids, params):
                ttft = ttft or time.perf_counter() - t0  # the prefill's end: what follows is decoding
                toks.append(t)
            dt = time.perf_counter() - t0
        return {"id": r.id, "ids": [t.id for t in toks], "logprobs": [t.logprob for t in toks],
                "accepted": [int(t.accepted) for t in toks], "drafted": sum(t.drafted for t in toks),
                "time_s": round(dt, 4), "ttft_s": round(ttft, 4), "tokens": len(toks)}

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(r) for r in reqs))
    return list(out), time.perf_counter() - t0


def run_one(model_dir: str, method: str, reqs: list[Request], warm: list[Request], temperature: float,
            concurrency: int, stops: list[int], adaptive: bool, spec_tokens: int, warm_tokens: int = WARM_TOKENS,
            load_format: str = "auto") -> dict:
    from serve.engine.native import EngineConfig, NativeEngine

    engine = NativeEngine(model_dir, EngineConfig(dtype="float64", speculative=method, max_num_seqs=max(8, concurrency),
                                                  num_speculative_tokens=spec_tokens, speculative_adaptive=adaptive,
                                                  load_format=load_format))
    try:
        # warm-up: other text into the drafter's cache, the step cost model fitted, first-call costs paid
        asyncio.run(replay(engine, warm, temperature, concurrency, stops, warm_tokens))
        before = engine.stats()
        results, wall = asyncio.run(replay(engine, reqs, temperature, concurrency, stops))
        after = engine.stats()
        cost = None
        if engine.spec is not None:  # the verify cost the engine learned from its own steps (batch 1 and 8)
            c = engine.spec.cost
            cost = {n: {"plain_ms": round(c.plain(n) * 1e3, 3), "seen": n in c.base,
                        "factor": [round(f, 3) for f in c.factors(n, 2 * spec_tokens)]} for n in (1, 8)}
    finally:
        asyncio.run(engine.stop())
    tokens = sum(r["tokens"] for r in results)
    accepted = sum(sum(r["accepted"]) for r in results)
    # the streams' decoding alone (after each first token): these outputs are short next to their prompts, so
    # the prefill is much of the wall time, and speculation only ever shortens what comes after it
    after_first = sum(r["tokens"] - 1 for r in results if r["tokens"] > 1)
    decode_s = sum(r["time_s"] - r["ttft_s"] for r in results if r["tokens"] > 1)
    # the same without the tokens a prefill's forward gave (a draft it verified): decode steps' tokens alone
    from_prefill = sum(first_forward(r["accepted"]) - 1 for r in results if r["tokens"] > 1)
    return {
        "method": method, "wall_s": round(wall, 4), "tokens": tokens, "tok_s": tokens / wall,
        "stream_decode_tok_s": after_first / max(decode_s, 1e-9),
        "decode_steps_tok_s": (after_first - from_prefill) / max(decode_s, 1e-9), "prefill_kept": from_prefill,
        "request_s": sum(r["time_s"] for r in results),
        "accepted": accepted, "forwards": tokens - accepted, "tok_per_forward": tokens / max(tokens - accepted, 1),
        "spec_drafted": after.spec_drafted - before.spec_drafted, "spec_accepted": after.spec_accepted - before.spec_accepted,
        "spec_verifies": after.spec_verifies - before.spec_verifies, "step_cost": cost, "requests": results,
    }


# -- analysis ---------------------------------------------------------------------------------------------

def token_kinds(chat, ids: list[int], in_reasoning: bool) -> list[str]:
    """Each token's kind by where its last character falls in the decoded completion: inside a tool call
    (Hermes <tool_call>…</tool_call> or XML <function=…</function>, tags included), inside reasoning, or
    answer prose. An unclosed region runs to the end."""
    dec = chat.tokenizer.decode
    text = dec(ids, skip_special_tokens=False)
    regions: list[tuple[int, int, str]] = []
    pos = 0
    if in_reasoning:
        end = text.find("</think>")
        pos = len(text) if end < 0 else end + len("</think>")
        regions.append((0, pos, "reasoning"))
    while True:
        hits = [(text.find(o, pos), kind, o, c) for kind, o, c in KIND_TAGS if text.find(o, pos) >= 0]
        if not hits:
            break
        start, kind, _, close = min(hits)
        end = text.find(close, start)
        end = len(text) if end < 0 else end + len(close)
        regions.append((start, end, kind))
        pos = end
    kinds, prev = [], 0
    for i in range(len(ids)):
        n = len(dec(ids[: i + 1], skip_special_tokens=False))
        at = max(n - 1, prev)  # the token's last character (a partial UTF-8 byte may have none of its own)
        kinds.append(next((k for s, e, k in regions if s <= at < e), "answer"))
        prev = n
    return kinds


def by_kind(chat, run: dict, reqs: dict[str, Request], cache: dict) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in run["requests"]:
        key = (tuple(r["ids"]), reqs[r["id"]].in_reasoning)
        if key not in cache:
            cache[key] = token_kinds(chat, r["ids"], reqs[r["id"]].in_reasoning)
        for kind, acc in zip(cache[key], r["accepted"], strict=True):
            d = out.setdefault(kind, {"tokens": 0, "accepted": 0})
            d["tokens"] += 1
            d["accepted"] += acc
    for d in out.values():
        d["accepted_share"] = d["accepted"] / d["tokens"]
        d["tok_per_forward"] = d["tokens"] / max(d["tokens"] - d["accepted"], 1)
    return out


def compare(off: dict, other: dict) -> dict:
    """Requests whose ids differ from off's, and the largest logprob difference where they agree."""
    a = {r["id"]: r for r in off["requests"]}
    differ, worst = [], 0.0
    for r in other["requests"]:
        w = a[r["id"]]
        if r["ids"] != w["ids"]:
            n = next((i for i, (x, y) in enumerate(zip(r["ids"], w["ids"], strict=False)) if x != y), min(len(r["ids"]), len(w["ids"])))
            differ.append({"id": r["id"], "first_difference": n, "tokens": [len(w["ids"]), len(r["ids"])]})
            continue
        for x, y in zip(r["logprobs"], w["logprobs"], strict=True):
            worst = max(worst, abs(x - y))
    return {"differ": differ, "max_logprob_diff": worst}


def summarize(reps: list[dict]) -> dict:
    """A method's repeats: median tokens/s; counts (the same work each repeat, greedy) from the first."""
    first = reps[0]
    out = {k: v for k, v in first.items() if k != "requests"}
    out["tok_s"] = statistics.median(r["tok_s"] for r in reps)
    out["tok_s_each"] = [round(r["tok_s"], 1) for r in reps]
    out["stream_decode_tok_s"] = statistics.median(r["stream_decode_tok_s"] for r in reps)
    out["decode_steps_tok_s"] = statistics.median(r["decode_steps_tok_s"] for r in reps)
    out["wall_s_each"] = [r["wall_s"] for r in reps]
    return out


def merge_checks(checks: list[dict]) -> dict:
    return {"differ": [d for c in checks for d in c["differ"]],
            "max_logprob_diff": max(c["max_logprob_diff"] for c in checks)}


# -- output -----------------------------------------------------------------------------------------------

def table(cells: list[dict]) -> str:
    lines = ["| set | temp | conc | tok/s off | ngram | suffix | speedup ngram | speedup suffix | tok/fwd ngram | "
             "tok/fwd suffix | accepted/drafted ngram | accepted/drafted suffix | stream decode speedup ngram | suffix | "
             "decode steps alone ngram | suffix | latency ngram | suffix |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        m = c["runs"]
        acc = {k: f"{m[k]['accepted'] / m[k]['spec_drafted']:.0%} of {m[k]['spec_drafted']}" if m[k]["spec_drafted"]
               else "- of 0" for k in ("ngram", "suffix")}
        lines.append(f"| {c['set']} | {c['temperature']:g} | {c['concurrency']} | {m['off']['tok_s']:.0f} | "
                     f"{m['ngram']['tok_s']:.0f} | {m['suffix']['tok_s']:.0f} | {c['speedup']['ngram']:.2f}x | "
                     f"{c['speedup']['suffix']:.2f}x | {m['ngram']['tok_per_forward']:.2f} | "
                     f"{m['suffix']['tok_per_forward']:.2f} | {acc['ngram']} | {acc['suffix']} | "
                     f"{c['stream_speedup']['ngram']:.2f}x | {c['stream_speedup']['suffix']:.2f}x | "
                     f"{c['decode_steps_speedup']['ngram']:.2f}x | {c['decode_steps_speedup']['suffix']:.2f}x | "
                     f"{c['latency_speedup']['ngram']:.2f}x | {c['latency_speedup']['suffix']:.2f}x |")
    return "\n".join(lines)


def kinds_table(cells: list[dict]) -> str:
    """Per set and method (greedy, batch 1: the cleanest acceptance), tokens by kind of text."""
    lines = ["| set | method | kind | tokens | accepted share | tok/fwd |", "| --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        if c["temperature"] != 0 or c["concurrency"] != 1:
            continue
        for m in ("ngram", "suffix"):
            for kind, d in sorted(c["runs"][m]["kinds"].items()):
                lines.append(f"| {c['set']} | {m} | {kind} | {d['tokens']} | {d['accepted_share']:.0%} | "
                             f"{d['tok_per_forward']:.2f} |")
    return "\n".join(lines)


def plot(cells: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    labels = [f"{c['set']}\nT={c['temperature']:g} c={c['concurrency']}" for c in cells]
    x = range(len(cells))
    fig, ax = plt.subplots(figsize=(max(8, len(cells) * 0.7), 4.5))
    for off, m in ((-0.2, "ngram"), (0.2, "suffix")):
        ax.bar([i + off for i in x], [c["speedup"][m] for c in cells], width=0.4, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.95, color="r", lw=0.6, ls="--", label="0.95 (never-repeating floor)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("decode tokens/s vs off")
    ax.set_title("Speculative decoding, built-in model (CPU, float64): speedup over no speculation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: {path}"


# -- main -------------------------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=Path, default=ROOT / "bench" / "spec-results" / "sessions")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "spec-results")
    p.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    p.add_argument("--limit", type=int, help="requests per set at most")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeat", type=int, default=3, help="runs of each off/ngram/suffix trio (medians reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine a second OpenMP thread waits on a busy "
                        "core, and decode steps of ~4 ms took 250 ms)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="default: the engine's")
    p.add_argument("--quick", action="store_true", help="a ~2-minute subset: 6 requests per set, greedy only")
    p.add_argument("--fixed", action="store_true",
                   help="no cost model (speculative_adaptive=False): the edit sets, greedy, batch 1; spec-fixed.json")
    p.add_argument("--record-limit", type=int, default=12, help="episodes per set when recording")
    p.add_argument("--warm-requests", type=int, default=WARM_REQUESTS,
                   help="requests of another set each engine serves first (their outputs fill the drafter's cache)")
    p.add_argument("--warm-tokens", type=int, default=WARM_TOKENS, help="max_tokens of each warm-up request")
    args = p.parse_args()
    if args.quick:
        args.limit, args.temperatures, args.repeat = args.limit or 6, [0.0], min(args.repeat, 2)
    if args.fixed:
        args.sets = [s for s in args.sets if s in EDIT_SETS] or list(EDIT_SETS)
        args.temperatures, args.concurrency = [0.0], [1]

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch starts its pool
    import torch

    torch.set_num_threads(args.threads)
    from serve.chat_format import ChatFormat
    from serve.cli import BUILTIN_DIR
    from serve.engine.drafter import DEFAULT_TOKENS
    from serve.model.config import ModelConfig

    spec_tokens = args.num_speculative_tokens or DEFAULT_TOKENS
    missing = [s for s in SETS if s not in ("random", "norepeat") and not any((args.sessions / s).glob("*.jsonl"))]
    if missing:
        from bench.spec_record import record

        print(f"recording sessions for {', '.join(missing)} into {args.sessions} (once)", flush=True)
        record(args.sessions, missing, args.record_limit)
    try:  # time the engine as it serves: with the C++ kernels (a first start would run the torch paths)
        from kernels import cpu_ext

        cpu_ext.build()
        kernels = True
    except Exception as e:  # noqa: BLE001
        print(f"note: the CPU kernels did not build ({e}): torch paths", flush=True)
        kernels = False

    model_dir = str(BUILTIN_DIR)
    chat = ChatFormat(model_dir)
    max_model_len = ModelConfig.from_dir(model_dir).max_position_embeddings
    every = {s: load_set(s, args.sessions, chat, max_model_len, None) for s in SETS}
    sets = {s: every[s][: args.limit] if args.limit else every[s] for s in args.sets}
    for s, reqs in sets.items():
        prompt = sum(len(r.ids) for r in reqs)
        # the built-in server counted the prompts of agent/ and stdlib/ when they were recorded: the same count
        # says the replay renders as the server did (the expert's server counts its own way)
        checked = [r for r in reqs if r.recorded_prompt_tokens is not None and s != "expert"]
        same = sum(1 for r in checked if r.recorded_prompt_tokens == len(r.ids))
        print(f"{s}: {len(reqs)} requests, {prompt} prompt tokens"
              + (f"; {same}/{len(checked)} render to the prompt token count the server recorded" if checked else ""),
              flush=True)

    t_start = time.perf_counter()
    cells, failures, kind_cache = [], [], {}
    for s, reqs in sets.items():
        other = SETS[(SETS.index(s) + 1) % len(SETS)]  # warm on another set's text
        warm = every[other][: args.warm_requests]
        byid = {r.id: r for r in reqs}
        for temp in args.temperatures:
            for conc in args.concurrency:
                reps: list[dict[str, dict]] = []
                for i in range(args.repeat):  # trios back to back: each ratio is read between neighbours
                    # the order turns each repeat: the first run of a trio measured a few percent slower
                    # whatever its method (ngram 1.08x on text where it drafted nothing, off always first)
                    order = METHODS[i % len(METHODS):] + METHODS[: i % len(METHODS)]
                    reps.append({m: run_one(model_dir, m, reqs, warm, temp, conc, chat.stop_token_ids, not args.fixed,
                                            spec_tokens, args.warm_tokens,
                                            "dummy" if s in RANDOM_WEIGHTS else "auto") for m in order})
                runs = {m: summarize([rep[m] for rep in reps]) for m in METHODS}
                for m in METHODS:
                    runs[m]["kinds"] = by_kind(chat, reps[0][m], byid, kind_cache)
                cell = {"set": s, "temperature": temp, "concurrency": conc, "runs": runs,
                        # per repeat the ratio to the off run beside it, then the median: drift cancels
                        "speedup": {m: statistics.median(rep[m]["tok_s"] / rep["off"]["tok_s"] for rep in reps)
                                    for m in METHODS},
                        "stream_speedup": {m: statistics.median(rep[m]["stream_decode_tok_s"]
                                                                / rep["off"]["stream_decode_tok_s"] for rep in reps)
                                           for m in METHODS},
                        # decode steps' own tokens only (the prefill's kept draft left out), and requests' latency
                        "decode_steps_speedup": {m: statistics.median(rep[m]["decode_steps_tok_s"]
                                                                      / rep["off"]["decode_steps_tok_s"] for rep in reps)
                                                 for m in METHODS},
                        "latency_speedup": {m: statistics.median(rep["off"]["request_s"] / rep[m]["request_s"]
                                                                 for rep in reps) for m in METHODS},
                        "checks": {m: merge_checks([compare(rep["off"], rep[m]) for rep in reps])
                                   for m in ("ngram", "suffix")},
                        "requests": {m: reps[0][m]["requests"] for m in METHODS}}
                for m, chk in cell["checks"].items():
                    bad = chk["differ"] or chk["max_logprob_diff"] > LOGPROB_TOL
                    if temp == 0 and bad:
                        failures.append(f"{s} c={conc} {m}: {len(chk['differ'])} request runs differ, "
                                        f"max logprob diff {chk['max_logprob_diff']:.2e}")
                cells.append(cell)
                r = runs
                print(f"{s} T={temp:g} c={conc}: tok/s off {r['off']['tok_s']:.0f}, ngram {r['ngram']['tok_s']:.0f} "
                      f"({cell['speedup']['ngram']:.2f}x, {r['ngram']['tok_per_forward']:.2f} tok/fwd), suffix "
                      f"{r['suffix']['tok_s']:.0f} ({cell['speedup']['suffix']:.2f}x, "
                      f"{r['suffix']['tok_per_forward']:.2f} tok/fwd); stream decode {cell['stream_speedup']['ngram']:.2f}x / "
                      f"{cell['stream_speedup']['suffix']:.2f}x (decode steps alone {cell['decode_steps_speedup']['suffix']:.2f}x"
                      f", {r['suffix']['prefill_kept']} tokens from prefills; latency "
                      f"{cell['latency_speedup']['suffix']:.2f}x); {r['off']['tokens']} tokens "
                      f"[{time.perf_counter() - t_start:.0f} s]", flush=True)

    print(f"\nbuilt-in model (CPU, float64), {'every proposal verified (--fixed)' if args.fixed else 'adaptive'}, "
          f"up to {spec_tokens} draft tokens:\n")
    print(table(cells))
    print("\nBy kind of text (greedy, batch 1):\n")
    print(kinds_table(cells))
    print()
    for s, reqs in sets.items():
        gen = [c["runs"]["off"]["tokens"] for c in cells if c["set"] == s]
        print(f"{s}: {len(reqs)} requests, {sum(len(r.ids) for r in reqs)} prompt tokens, generated per run (off): "
              f"{', '.join(map(str, gen))} tokens")
    seeded = [f"{c['set']} c={c['concurrency']} {m}: {len(chk['differ'])}/{len(c['runs']['off']['requests'])}"
              for c in cells if c["temperature"] > 0 for m, chk in c["checks"].items() if chk["differ"]]
    if seeded:
        print("seeded (T=1) requests whose tokens differ from off (not a failure: reduction order): " + "; ".join(seeded))
    verdict = "PASS" if not failures else "FAIL"
    print(f"\ngreedy identical to off on every replayed request (ids, logprobs within {LOGPROB_TOL:g}): {verdict}")
    for f in failures:
        print("  " + f)

    args.out.mkdir(parents=True, exist_ok=True)
    name = "spec-fixed" if args.fixed else "spec"
    meta = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpu_kernels": kernels,
                        "load_avg": os.getloadavg()},
            "adaptive": not args.fixed, "num_speculative_tokens": spec_tokens, "greedy_check": verdict,
            "failures": failures, "elapsed_s": round(time.perf_counter() - t_start, 1),
            "sets": {s: {"requests": len(r), "prompt_tokens": sum(len(x.ids) for x in r)} for s, r in sets.items()}}
    slim = [{k: v for k, v in c.items() if k != "requests"} for c in cells]
    (args.out / f"{name}.json").write_text(json.dumps({**meta, "cells": slim}, indent=1))
    # every request's tokens, logprobs, time (the first repeat): compact, beside it
    per_request = [{"set": c["set"], "temperature": c["temperature"], "concurrency": c["concurrency"],
                    "requests": {m: [{**r, "logprobs": [round(x, 8) for x in r["logprobs"]]} for r in reqs]
                                 for m, reqs in c["requests"].items()}} for c in cells]
    (args.out / f"{name}-requests.json").write_text(json.dumps(per_request, separators=(",", ":")))
    print(f"\nJSON: {args.out / f'{name}.json'}")
    if not args.fixed:
        print(plot(cells, args.out / f"{name}.png"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
