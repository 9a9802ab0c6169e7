"""bench/gpu.py's `invariant` section: the fixed-order batch-invariant mode (serve/model/numerics.py,
kernels/batch_invariant_triton.py) against the default engine, on the device.

- decode: ms per decode step at batch 1/8/32, the default engine and the batch-invariant one
  (`batch_invariant="fixed"`, what True picks on a GPU; experts MXFP8, dequantized in registers), both
  through the static decode step in CUDA graphs on a GPU, side by side, and the ratio (the goal: <= 1.5x).
  Same shape, same random weights.
- bitwise, in bfloat16 on the device: greedy tokens and log-probs of one prompt decoded alone equal those
  of the same prompt decoded among 7 others; the model's whole-sequence forward (the trainer's
  `forward_train`, same kernels) gives the decode steps' log-probs bit for bit; and that forward captured
  in a CUDA graph replays to the same bits.

The shape is the Qwen3-30B-A3B one at LAYERS layers (random weights made on the device), to fit the
section's budget; on a CPU (REDUCED shape) the fixed kernels run only under TRITON_INTERPRET=1 (tests do
that, at a tiny shape), and the section says it skipped otherwise.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch

from serve.engine.base import SamplingParams
from serve.engine.native import EngineConfig, NativeEngine
from serve.model.numerics import resolve_mode

LAYERS = 8  # of the 30B shape's 48: the ratio is per layer; the default engine's step at 48 is in `decode`


def make(folder: Path, device: str, invariant: bool, max_seqs: int, kv_tokens: int, chunk: int, max_len: int):
    return NativeEngine(str(folder), EngineConfig(
        device=device, dtype="bfloat16", quant="mxfp8", load_format="dummy", batch_invariant="fixed" if invariant else False,
        static_decode=None, max_num_seqs=max_seqs, kv_cache_tokens=kv_tokens,
        max_batched_tokens=chunk, max_model_len=max_len))


def greedy(engine: NativeEngine, prompts: list[list[int]], n: int) -> list[list[tuple[int, float]]]:
    """(id, log-prob) of n greedy tokens for each prompt, all at once."""
    async def one(p):
        params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=True)
        return [(t.id, t.logprob) async for t in engine.generate(p, params)]

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(main())


def trainer_logprobs(engine: NativeEngine, prompt: list[int], picks: list[tuple[int, float]]) -> torch.Tensor:
    """The whole sequence through the model's training forward (no cache, same kernels): log-prob of each
    decoded token."""
    ids = torch.tensor([prompt + [t for t, _ in picks]], device=engine.device)
    with torch.no_grad():
        logits = engine.model.forward_train(ids)[0, len(prompt) - 1: len(prompt) - 1 + len(picks)]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, ids[0, len(prompt):, None])[:, 0].cpu()


def graph_replay_matches(model, ids: torch.Tensor) -> dict:
    """forward_train captured in a CUDA graph: does the replay give the eager bits, and how long does each take."""
    with torch.no_grad():
        eager = model.forward_train(ids)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.forward_train(ids)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model.forward_train(ids)
        graph.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(out, eager))
        times = {}
        for name, fn in (("eager_ms", lambda: model.forward_train(ids)), ("graph_ms", graph.replay)):
            fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - t) * 100
    return {"graph_equal": same, "tokens": ids.shape[1], **times}


def section(g, plan, report, deadline: float) -> None:
    """g: the bench/gpu.py module (its clock, helpers and report)."""
    sec = report.section("invariant")
    budget = g.Budget(plan.budgets.get("invariant", 120 if g.CUDA else 60), deadline)
    try:
        resolve_mode("fixed", plan.device)
    except ValueError as e:
        sec["skipped"].append(f"the fixed mode cannot run here: {e}")
        g.log(f"invariant: skipped ({e})")
        return
    layers = min(plan.layers, LAYERS)
    shape = dict(plan.shape, num_hidden_layers=layers)
    sec["shape"] = {"layers": layers, "reduced_cpu_shape": plan.reduced}
    folder = g.scratch()
    (folder / "config.json").write_text(json.dumps(shape))
    batches = getattr(plan, "invariant_batches", None) or ([1, 8, 32] if g.CUDA else [1, 2])
    new = getattr(plan, "invariant_tokens", None) or (16 if g.CUDA else 4)
    prompt_len = plan.prompt_len
    kv = max(batches) * (prompt_len + new + 16) + 1024
    max_len = prompt_len + new + 64
    vocab = shape["vocab_size"]
    steps: dict[str, dict[int, float]] = {}
    for label, invariant in (("default", False), ("fixed", True)):
        engine = make(folder, plan.device, invariant, max(batches), kv, max(2048, prompt_len), max_len)
        clock = g.StepClock(engine)
        try:
            if invariant:
                sec["engine"] = engine.describe()
            for b in batches:
                if budget.left() < 5:
                    sec["skipped"].append(f"{label} batch {b}: budget")
                    continue
                with g.guarded(report, "invariant", f"{label} batch {b}"):
                    mark = clock.mark()
                    res = g.run_requests(engine, g.random_prompts(b, prompt_len, vocab, seed=b), new, seed=b,
                                         clock=clock)
                    row = {"kind": "decode", "engine": label, **g.decode_row(clock, mark, b, res)}
                    sec["rows"].append(row)
                    steps.setdefault(label, {})[b] = row["step_ms"]
                    g.log(f"invariant {label} batch {b}: step {row['step_ms']:.2f} ms")
            if invariant:
                bitwise(g, engine, plan, report, vocab, new)
        finally:
            g.stop_engine(engine)
            g.free_memory()
    rows = [{"batch": b, "default_ms": steps["default"][b], "fixed_ms": steps["fixed"][b],
             "ratio": steps["fixed"][b] / steps["default"][b]}
            for b in batches if b in steps.get("default", {}) and b in steps.get("fixed", {})]
    sec["rows"] += [{"kind": "ratio", **r} for r in rows]
    g.table(f"batch-invariant (fixed) vs default decode step, {layers} layers, MXFP8 experts", rows,
            [("batch", "batch", "d"), ("default_ms", "default ms", ".2f"), ("fixed_ms", "fixed ms", ".2f"),
             ("ratio", "x", ".2f")])


def bitwise(g, engine: NativeEngine, plan, report, vocab: int, new: int) -> None:
    sec = report.section("invariant")
    prompts = g.random_prompts(getattr(plan, "invariant_prompts", 8), plan.prompt_len, vocab, seed=99)
    with g.guarded(report, "invariant", "bitwise"):
        alone = greedy(engine, prompts[:1], new)[0]
        batch = greedy(engine, prompts, new)  # the same prompt first among the others
        scored = trainer_logprobs(engine, prompts[0], alone)
        served = torch.tensor([lp for _, lp in alone])
        row = {"kind": "bitwise", "dtype": "bfloat16", "tokens": len(alone),
               "alone_equals_batch": batch[0] == alone,
               "trainer_equals_server": bool(torch.equal(scored, served)),
               "trainer_gap_max": float((scored - served).abs().max())}
        sec["rows"].append(row)
        g.log(f"invariant bitwise: alone == in batch {row['alone_equals_batch']}, trainer == server "
              f"{row['trainer_equals_server']} (max gap {row['trainer_gap_max']:.2e})")
        if not (row["alone_equals_batch"] and row["trainer_equals_server"]):
            raise AssertionError(f"not bitwise: {row}")
    if g.CUDA:  # apart: a capture that fails must not lose the rows above
        with g.guarded(report, "invariant", "cuda graph"):
            row = {"kind": "graph", **graph_replay_matches(engine.model, torch.tensor([prompts[0][:64]],
                                                                                       device=engine.device))}
            sec["rows"].append(row)
            g.log(f"invariant: forward captured in a CUDA graph replays to the eager bits: {row['graph_equal']} "
                  f"({row['graph_ms']:.2f} ms vs {row['eager_ms']:.2f} ms eager, {row['tokens']} tokens)")
            if not row["graph_equal"]:
                raise AssertionError(f"graph replay differs from eager: {row}")
