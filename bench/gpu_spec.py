"""bench/gpu.py's `spec` section: what verifying a draft costs at the Qwen3-30B-A3B shape, and the speedup
that cost and a measured acceptance give.

Verification is the decode step with a row per token (serve/engine/speculation.py): q query tokens per
sequence (its last token and q - 1 draft tokens). Random weights accept nothing, so speed cannot be
measured on a GPU by replaying traffic through a random model; instead this section measures the verify
step's time t(B, q) for q = 1..16 query tokens per sequence at batch B = 1/8/32 (the engine's static
step, CUDA graphs, MXFP8 experts: rows read the union of their experts, which is the MoE caveat this
measures rather than assumes), and projects tokens/s from the acceptance that bench/spec.py measured on
the CPU replay of real agent traffic (its tokens per forward and mean draft length per verifying step):

    projected speedup(B) = tokens per forward x t(B, 1) / t(B, 1 + mean draft)

(t interpolated between the measured q). The projection is labelled as one: it assumes the GPU model
accepts drafts as often as the built-in model did on the CPU.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from serve.engine.base import SamplingParams
from serve.engine.sampling import make_generator
from serve.engine.sequence import Sequence

QUERIES = (1, 2, 3, 4, 6, 8, 12, 16)
REPEATS = 5


def verify_costs(engine, batches: list[int], queries: tuple[int, ...], prompt_len: int, vocab: int,
                 budget_left) -> list[dict]:
    """t(B, q): the static step with B sequences of `prompt_len` context, each verifying q - 1 draft tokens,
    timed (synchronised) as the median of REPEATS after two warm-up steps (graph capture). Runs from this
    thread while the engine thread idles: the sequences never enter the scheduler."""
    runner, blocks = engine.runner, engine.blocks
    if runner.static is None:
        raise RuntimeError("the engine has no static decode step")
    rows = []
    g = torch.Generator().manual_seed(0)
    for B in batches:
        params = SamplingParams(max_tokens=64, temperature=0.0)
        seqs = []
        for _ in range(B):
            seq = Sequence(torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist(), params)
            seq.generator = make_generator(params)
            if not blocks.allocate(seq):
                raise RuntimeError("KV cache too small for the verify table")
            runner.run([(seq, len(seq) - seq.num_computed)])
            seq.num_computed = len(seq)
            seq.token_ids.append(11)
            seqs.append(seq)
        try:
            for q in queries:
                if budget_left() < 5:
                    break
                for seq in seqs:
                    seq.draft = [12 + i for i in range(q - 1)]
                    if not blocks.ensure(seq, len(seq) + q - 1):
                        raise RuntimeError("KV cache too small for the verify table")
                times = []
                for i in range(2 + REPEATS):
                    _sync()
                    t = time.perf_counter()
                    runner.static.step(seqs)  # one transfer back: synchronised by itself
                    if i >= 2:
                        times.append(time.perf_counter() - t)
                rows.append({"batch": B, "query_tokens": q, "rows": B * q, "step_ms": 1e3 * statistics.median(times)})
        finally:
            for seq in seqs:
                seq.draft = []
                blocks.free(seq)
                runner.forget(seq)
    base = {r["batch"]: r["step_ms"] for r in rows if r["query_tokens"] == 1}
    for r in rows:
        r["vs_decode"] = r["step_ms"] / base[r["batch"]] if r["batch"] in base else None
    return rows


def acceptance(path: Path) -> list[dict]:
    """What bench/spec.py measured (greedy, batch 1, suffix drafts): per set, tokens per forward and the
    mean draft length of a verifying step. Empty when it has not run."""
    if not path.exists():
        return []
    out = []
    for cell in json.loads(path.read_text()).get("cells", []):
        run = cell.get("runs", {}).get("suffix")
        if run is None or cell.get("temperature") != 0 or cell.get("concurrency") != 1:
            continue
        verifies = run.get("spec_verifies") or 0
        out.append({"set": cell["set"], "tokens_per_forward": run.get("tok_per_forward"),
                    "mean_draft": run.get("spec_drafted", 0) / verifies if verifies else 0.0,
                    "cpu_speedup": (cell.get("speedup") or {}).get("suffix")})
    return out


def projections(costs: list[dict], measured: list[dict]) -> list[dict]:
    out = []
    for m in measured:
        if not m["tokens_per_forward"]:
            continue
        for B in sorted({r["batch"] for r in costs}):
            pts = sorted((r["query_tokens"], r["step_ms"]) for r in costs if r["batch"] == B)
            if not pts or pts[0][0] != 1:
                continue
            t = _interp(pts, 1 + m["mean_draft"])
            out.append({"set": m["set"], "batch": B, "tokens_per_forward": m["tokens_per_forward"],
                        "mean_draft": m["mean_draft"], "verify_vs_decode": t / pts[0][1],
                        "projected_speedup": m["tokens_per_forward"] * pts[0][1] / t})
    return out


def _interp(pts: list[tuple[int, float]], q: float) -> float:
    if q <= pts[0][0]:
        return pts[0][1]
    for (q0, t0), (q1, t1) in zip(pts, pts[1:], strict=False):
        if q <= q1:
            return t0 + (t1 - t0) * (q - q0) / (q1 - q0)
    return pts[-1][1]  # past the last measured q: the largest, an underestimate of its cost


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
