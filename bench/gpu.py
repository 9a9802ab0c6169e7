"""composer-serve and the trainer on one GPU in one run: parity, decode speed, transformers, per-step
overheads, kernels, a training step.

    python bench/gpu.py                                 # all sections (GPU: budgeted to ~8 minutes; 3-4 on an H200)
    python bench/gpu.py --sections decode,profile --layers 24 --out /tmp/gpu
    python bench/gpu.py --quick                         # fewer batches and tokens
    python bench/gpu.py --tune                          # first tune the decode kernels (<= 4 min), write kernels/tuned/

Sections (each in its own try/except and wall-clock budget, so one failing or running long does not stop
the rest; budgets are checked between measurements):
- parity: a tiny random checkpoint (serve.tiny), the native engine (float32/bfloat16, experts none/MXFP8)
  against transformers float32 on the same token ids: max |logit gap|, and greedy sequences against
  transformers' greedy ones. transformers bfloat16 against its own float32 is the baseline gap.
- decode: the Qwen3-30B-A3B shape (--layers of its 48) with random weights made on the device
  (load_format="dummy", serve/model/dummy.py), experts MXFP8 and bf16: ms per decode step and tokens/s
  at batch 1/8/32/128 (bf16 experts: 1/8/32), an 8k-token prefill, for the default engine (CUDA graphs
  where the engine has them) and enforce_eager=True side by side at batch 1 and 32. A step's time is the
  engine's own `_step` (wrapped, synchronised), median over the steps where every sequence of the batch
  decodes; `interval` is start to start of those steps (the scheduler and token streaming included),
  and tokens/s is the batch over that interval.
- hf: transformers' `generate` at the same shape (bf16, random weights made on the device), batch 1 and
  8: median time between tokens (a stopping criterion stamps each one).
- profile: torch.profiler on the engine thread over decode steps at batch 1 and 32 (default and eager
  engines, MXFP8): kernel launches, CUDA graph launches, GPU kernels run, host synchronisations and copies
  (H2D/D2H/D2D) per step, and the kernels that take the most GPU time.
- spec: speculative decoding's verify step (bench/gpu_spec.py): step time for 1..16 query tokens per
  sequence at batch 1/8/32 (MXFP8 experts, CUDA graphs), and the speedup projected from the acceptance
  bench/spec.py measured on the CPU replay of real agent traffic (random weights accept nothing).
- kernels: bench/kernels.py's quantizer and MoE layer tables (its functions), tokens 1..4096; on a GPU also each
  decode MoE kernel's bandwidth alone in a CUDA graph at 1, 8 and 32 tokens (expert codes + scales read / device
  time, % of copy), today's kernels and what this GPU's tuned table picks (bench/gpu_tune.py).
- tune (first, with --tune): bench/gpu_tune.py sweeps the decode kernels' configurations (MoE decode variants:
  split-K, swap-AB, FMA GEMV, tiles; the FP8 W8A16 kernel's tiles and split) at the 30B decode step's shapes
  (1, 8, 32, 16, 64 tokens) in graphs, within ~4 minutes, writes the winners to kernels/tuned/<gpu>.json (the
  kernels read it at start-up, so the later sections run tuned) and reports the kernels' bandwidth with it.
  On a CPU it runs only under TRITON_INTERPRET=1 (its test runs it at a tiny shape) and writes to --out.
- fp8: FP8 dense layers (--quant-dense fp8, bench/gpu_fp8.py): the W8A16 kernel against bf16 F.linear at the
  q/k/v, o and LM head shapes (1..64 rows and a prefill chunk), then two engines with the same random
  weights, quant_dense none and fp8: the logit gap along a forced sequence and decode steps at batch 1/8/32.
- train: the trainer's expert backward (grouped GEMMs, kernels/moe_grouped.py) against autograd through the
  reference on this device, then one RL step at the 4-layer Qwen3-30B-A3B shape, 8 x 2,048 tokens, half
  trained, micro-batches of 4,096 (bench/train_step.py): seconds, tokens/s, MFU of a measured bf16 matmul
  rate, peak memory against the memory plan, forward/backward/optimizer split; with and without
  activation checkpointing, then (on a GPU) each trainer option of bench/train_step.py OPTIONS (fused expert
  backward, norms, LM head, all three, one 16k micro-batch) beside the default, each row naming its option; on a GPU a profiled step adds its top ops.
- rl (only when named: `--sections rl`): a few colocated RL steps (bench/gpu_rl.py): the native engine and
  the trainer in this process on one device, 8 layers of the 30B shape (4 where the memory plan says 8 do
  not fit), random weights, one-turn synthetic tasks through the real agent loop with a scripted verifier:
  rollout and train tokens/s, the KV cache's release and restore, the weight hand-over in memory against the
  disk path, and the step's time split.
- invariant (only when named: `--sections invariant`): the batch-invariant mode's fixed-order kernels
  (bench/gpu_invariant.py) against the default engine at 8 layers of the 30B shape: decode step ms at batch
  1/8/32 and their ratio; bitwise in bf16 on the device (a prompt alone vs among 8, the training forward vs
  the decode steps' log-probs, a CUDA-graph replay of that forward vs eager).
- tests: pytest on the test files whose GPU paths only a GPU runs (GPU_TEST_FILES: the Triton kernels on the
  device, CUDA-only tests), in a child process: counts, and each failure's id and error line.

Without CUDA every section runs a REDUCED shape (2 layers, hidden 128, 8 experts top-2, vocabulary 1024,
batches 1 and 4, a 256-token prefill, a small kernel table) in well under a minute on 2 cores: a check that
the benchmark runs, not figures about any GPU. The output says so. Tables go to stdout; the JSON
(device, versions, every figure) to --out DIR as gpu-DATE.json (gpu-DATE-cpu-reduced.json on a CPU),
rewritten after every measurement so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # a first engine start would build the CPU kernels in the background: 30-60 s of compiling on the
    # cores being measured. Already built ones are used.
    os.environ.setdefault("COMPOSER_KERNEL_BUILD", "0")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this folder holds a kernels.py: the package must win

from serve.engine.base import SamplingParams  # noqa: E402
from serve.engine.native import EngineConfig, NativeEngine  # noqa: E402
from serve.engine.parity import forced_logits  # noqa: E402
from serve.model.config import QWEN3_30B_A3B  # noqa: E402

OPT_IN = ("rl", "invariant")  # run only when named in --sections
SECTIONS = ("parity", "decode", "hf", "profile", "spec", "kernels", "fp8", "train", "tests")
REDUCED = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2)
# Seconds per section on a GPU; the decode section's includes the profile (they share the engines).
# Sized from the probe that measured the first GPU figures (one H200); the whole run took 143 s there
# on 2026-11-27 before the tests section.
GPU_BUDGETS = {"parity": 50, "decode-mxfp8": 125, "decode-none": 70, "hf": 50, "spec": 80, "kernels": 60, "fp8": 60,
               "train": 120, "tests": 130}  # tests: +30 s for the decode variants on the device; train: 8 trainer runs
CPU_BUDGETS = {"parity": 30, "decode-mxfp8": 50, "decode-none": 20, "hf": 15, "spec": 30, "kernels": 15, "fp8": 20,
               "train": 30, "tests": 60}
TUNE_BUDGET = 210  # seconds of --tune's sweep; with the bandwidth report after it the section stays under 4 minutes
# The test files whose GPU paths only a GPU runs (CUDA-only tests, the Triton kernels compiled for the device);
# on a CPU the section runs the first alone, to check that the section works.
GPU_TEST_FILES = ("tests/kernels/test_backend.py", "tests/kernels/test_moe.py", "tests/kernels/test_mxfp8.py",
                  "tests/kernels/test_mxfp8_linear.py", "tests/kernels/test_moe_align.py",
                  "tests/kernels/test_moe_grouped.py", "tests/kernels/test_fused.py",
                  "tests/kernels/test_paged_attention_triton.py", "tests/kernels/test_fp8_linear.py",
                  "tests/kernels/test_batch_invariant_kernels.py", "tests/serve/test_static_decode.py",
                  "tests/serve/test_speculative.py", "tests/kernels/test_moe_decode_variants.py",
                  "tests/kernels/test_tuning.py")
WARM_STEPS = 2  # decode steps dropped at each batch: first replays, allocator growth


class Plan:
    """What to measure: the GPU shape, the reduced CPU shape, and --quick's cuts."""

    def __init__(self, args: argparse.Namespace):
        self.device = "cuda" if CUDA else "cpu"
        self.reduced = not CUDA
        self.layers = args.layers or (48 if CUDA else 2)
        self.shape = dict(QWEN3_30B_A3B, num_hidden_layers=self.layers)
        if self.reduced:
            self.shape.update(REDUCED)
        self.batches = {"mxfp8": [1, 8, 32, 128], "none": [1, 8, 32]} if CUDA else {"mxfp8": [1, 4], "none": [1, 4]}
        self.eager_batches = [1, 32] if CUDA else [1, 4]
        self.profile_batches = [1, 32] if CUDA else [1, 4]
        self.prompt_len = 256 if CUDA else 32
        # tokens per request: the median is over these less the warm steps. bf16 experts (the torch
        # reference, ~0.2-1 s a step at the full shape) get fewer so that the section fits its budget
        self.new_tokens = {"mxfp8": 24, "none": 12} if CUDA else {"mxfp8": 8, "none": 8}
        self.prefill = 8192 if CUDA else 256
        self.hf_batches = [1, 8] if CUDA else [1, 4]
        self.kernel_tokens = [1, 8, 64, 512, 4096] if CUDA else [1, 8, 64]
        self.parity_prompts, self.parity_tokens = (8, 32) if CUDA else (4, 12)
        self.profile_steps = 6 if CUDA else 3
        self.prefill_experts = ("mxfp8", "none")
        # on a GPU the first long prompt compiles kernels for its sizes; a CPU has nothing to compile
        self.prefill_runs = ("cold", "warm") if CUDA else ("warm",)
        if args.quick:
            self.batches = {"mxfp8": [1, 32], "none": [1]} if CUDA else {"mxfp8": [1], "none": [1]}
            self.eager_batches = self.profile_batches = [1]
            self.new_tokens = {k: max(8, v // 2) for k, v in self.new_tokens.items()}
            self.hf_batches = [1]
            self.kernel_tokens = [1, 64, 4096] if CUDA else [1, 8]
            self.parity_prompts = 4
            self.prefill_experts = ("mxfp8",)
        self.budgets = dict(GPU_BUDGETS if CUDA else CPU_BUDGETS)


# -- output ------------------------------------------------------------------------------------------------

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def table(title: str, rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """cols: (key, header, format spec); a missing or None value prints as '-'."""
    print(f"\n## {title}", flush=True)
    if not rows:
        print("(nothing measured)", flush=True)
        return
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else format(r[k], f) if f else str(r[k])) for k, _, f in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for i, line in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)), flush=True)
        if i == 0:
            print("  ".join("-" * w for w in widths), flush=True)


class Report:
    """The JSON: metadata and one entry per section, rewritten after each measurement."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.data = path, {"meta": meta, "sections": {}}

    def section(self, name: str) -> dict:
        return self.data["sections"].setdefault(name, {"status": "running", "rows": [], "errors": [],
                                                       "skipped": [], "seconds": 0.0})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


class Budget:
    def __init__(self, seconds: float, deadline: float):
        self.end = min(time.perf_counter() + seconds, deadline)

    def left(self) -> float:
        return self.end - time.perf_counter()


@contextlib.contextmanager
def guarded(report: Report, name: str, what: str):
    """One measurement of a section: an exception is reported in its entry, and the run goes on."""
    sec = report.section(name)
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a failed measurement is a result; the rest still runs
        traceback.print_exc()
        sec["errors"].append(f"{what}: {type(e).__name__}: {e}"[:1000])
        log(f"{name}: {what} FAILED: {type(e).__name__}: {e}")
    finally:
        report.save()


_SCRATCH: list[Path] = []


def scratch() -> Path:
    """A temporary folder, removed when the run ends (a tiny checkpoint, config.json files)."""
    _SCRATCH.append(Path(tempfile.mkdtemp(prefix="composer-gpu-bench-")))
    return _SCRATCH[-1]


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def gib(n: float) -> float:
    return n / 2**30


# -- engines -----------------------------------------------------------------------------------------------


class StepClock:
    """Wraps one engine's `_step` (on the instance, run by the engine thread): each step's wall time,
    synchronised, and whether every sequence in it decodes; and, when asked, a profiler window over
    exactly N decode steps at a given batch."""

    def __init__(self, engine: NativeEngine):
        self.steps: list[dict] = []
        self._inner = engine._step
        self._want: dict | None = None
        self._idle = threading.Event()
        self._idle.set()
        engine._step = self._step

    def _step(self, batch) -> None:
        self._idle.clear()
        try:
            self._timed_step(batch)
        finally:
            self._idle.set()

    def _timed_step(self, batch) -> None:
        decode = all(n == 1 and seq.num_computed > 0 for seq, n in batch)
        want = self._want
        hit = want is not None and decode and len(batch) == want["batch"]
        if hit and want["skip"] > 0:
            want["skip"] -= 1
            hit = False
        if hit and want["prof"] is None:
            sync()  # before the window: not one of the steps' synchronisations
            self._on_loop(batch, want, "start")
        t = time.perf_counter()
        self._inner(batch)
        if not hit:  # inside the window: one synchronisation at its end, subtracted from the counts
            sync()
        self.steps.append({"t": t, "s": time.perf_counter() - t, "n": len(batch), "decode": decode,
                           "tokens": sum(n for _, n in batch)})
        if hit:
            want["done"] += 1
            if want["done"] == want["steps"]:
                sync()
                self._on_loop(batch, want, "stop")
                self._want = None

    @staticmethod
    def _on_loop(batch, want: dict, what: str) -> None:
        """Start or stop the profiler on the requests' event-loop thread (the main one) while the engine
        thread waits, so the window holds exactly the wanted steps. Kineto wants to be driven from the
        thread that registered it; profile_all_threads lets it see the engine thread's ops."""
        done = threading.Event()

        def call() -> None:
            try:
                if what == "start":
                    want["prof"] = _profiler()
                    want["prof"].start()
                else:
                    want["prof"].stop()
                    want["stopped"] = True
            except Exception as e:  # noqa: BLE001 - raised on the engine thread below
                want["error"] = e
            finally:
                done.set()

        batch[0][0].loop.call_soon_threadsafe(call)
        if not done.wait(120) or "error" in want:
            raise RuntimeError(f"profiler {what} failed: {want.get('error', 'timed out')}")

    def settle(self) -> None:
        """Wait for the step in progress to be recorded: its last tokens reach the caller from inside it."""
        if not self._idle.wait(120):
            raise RuntimeError("the engine's step did not end in 120 s")

    def profile(self, batch: int, steps: int, skip: int) -> dict:
        self._want = {"batch": batch, "steps": steps, "skip": skip, "done": 0, "prof": None}
        return self._want

    def mark(self) -> int:
        return len(self.steps)


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    try:  # the engine thread's ops, whichever thread the profiler is driven from
        from torch._C._profiler import _ExperimentalConfig
        return profile(activities=acts, experimental_config=_ExperimentalConfig(profile_all_threads=True))
    except (ImportError, TypeError):
        return profile(activities=acts)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def run_requests(engine: NativeEngine, prompts: list[list[int]], max_tokens: int, seed: int,
                 clock: StepClock | None = None) -> dict:
    """All prompts at once through engine.generate; their wall time and first-token times. With `clock`,
    returns once the last step is recorded too."""
    async def one(p, i):
        first, n, start = None, 0, time.perf_counter()
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed * 1000 + i)
        async for _ in engine.generate(p, params):
            n += 1
            first = first or time.perf_counter() - start
        return first, n

    async def main():
        start = time.perf_counter()
        got = await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))
        return time.perf_counter() - start, got

    wall, got = asyncio.run(main())
    if clock is not None:
        clock.settle()
    return {"wall_s": wall, "ttft_s": max(f for f, _ in got), "tokens": sum(n for _, n in got)}


def make_engine(model_dir: Path, plan: Plan, quant: str, eager: bool, max_seqs: int, kv_tokens: int,
                model=None, spec_tokens: int = 0, quant_dense: str = "none") -> NativeEngine:
    """A dummy-weight engine (load_format="dummy"); with `model`, that one instead of drawing a new one."""
    import serve.engine.native as native
    import serve.model.dummy as dummy

    # static_decode: the GPU's decode step (on a CPU too, without graphs, so the reduced run exercises it)
    config = EngineConfig(device=plan.device, dtype="bfloat16", quant=quant, quant_dense=quant_dense, load_format="dummy",
                          static_decode=True, enforce_eager=eager, max_num_seqs=max_seqs, kv_cache_tokens=kv_tokens,
                          max_batched_tokens=max(plan.prefill, 2048), max_model_len=plan.prefill + 1024,
                          **(dict(speculative="suffix", num_speculative_tokens=spec_tokens) if spec_tokens else {}))
    if model is None:
        return NativeEngine(str(model_dir), config)
    # the engine imports random_model when it loads; patched where it may have been imported from too
    homes = [m for m in (dummy, native) if hasattr(m, "random_model")]
    real = [m.random_model for m in homes]
    for m in homes:
        m.random_model = lambda *a, **kw: model
    try:
        return NativeEngine(str(model_dir), config)
    finally:
        for m, f in zip(homes, real, strict=True):
            m.random_model = f


def stop_engine(engine: NativeEngine) -> None:
    asyncio.run(engine.stop())
    engine._thread.join(timeout=60)


def decode_row(clock: StepClock, mark: int, batch: int, result: dict) -> dict:
    window = clock.steps[mark:]
    full = [s["decode"] and s["n"] == batch for s in window]
    steps = [s for s, f in zip(window, full, strict=True) if f]
    timed = steps[WARM_STEPS:] if len(steps) > WARM_STEPS + 2 else steps
    if not timed:
        raise RuntimeError(f"no decode step at batch {batch} (steps: {[(s['n'], s['decode']) for s in window]})")
    step_ms = 1e3 * statistics.median(s["s"] for s in timed)
    # start to start of two consecutive full decode steps: what the engine loop adds between steps counts
    gaps = [b["t"] - a["t"] for a, b, fa, fb in zip(window, window[1:], full, full[1:], strict=False) if fa and fb]
    gaps = (gaps[WARM_STEPS:] if len(gaps) > WARM_STEPS + 2 else gaps) or [timed[0]["s"]]
    interval_ms = 1e3 * statistics.median(gaps)
    return {"batch": batch, "step_ms": step_ms, "step_min_ms": 1e3 * min(s["s"] for s in timed),
            "interval_ms": interval_ms, "tok_s": batch * 1e3 / interval_ms, "tok_s_per_seq": 1e3 / interval_ms,
            "decode_steps": len(timed), "ttft_ms": 1e3 * result["ttft_s"], "wall_s": result["wall_s"]}


def measure_decode(engine: NativeEngine, clock: StepClock, plan: Plan, quant: str, label: str, batches: list[int],
                   budget: Budget, report: Report) -> float:
    """Decode rows for these batches; returns the last step's seconds (to estimate what fits)."""
    sec, last = report.section("decode"), 0.0
    vocab = plan.shape["vocab_size"]
    for b in batches:
        need = (plan.new_tokens[quant] + 4) * last * max(1.0, b / 8) ** 0.5
        if budget.left() < need:
            sec["skipped"].append(f"{quant}/{label} batch {b}: {budget.left():.0f} s left of the budget, ~{need:.0f} s needed")
            log(f"decode {quant}/{label} batch {b}: skipped (budget)")
            continue
        with guarded(report, "decode", f"{quant}/{label} batch {b}"):
            mark = clock.mark()
            res = run_requests(engine, random_prompts(b, plan.prompt_len, vocab, seed=b), plan.new_tokens[quant], seed=b,
                               clock=clock)
            row = {"kind": "decode", "experts": quant, "engine": label, **decode_row(clock, mark, b, res)}
            sec["rows"].append(row)
            last = row["interval_ms"] / 1e3
            log(f"decode {quant}/{label} batch {b}: step {row['step_ms']:.2f} ms (interval {row['interval_ms']:.2f} ms)"
                f" = {row['tok_s']:.0f} tok/s; first token {row['ttft_ms']:.0f} ms")
    return last


def measure_prefill(engine: NativeEngine, clock: StepClock, plan: Plan, quant: str, budget: Budget,
                    report: Report) -> None:
    """The prompt's steps (one at --prefill <= max_batched_tokens), cold then warm (kernels compiled)."""
    sec = report.section("decode")
    row = {"kind": "prefill", "experts": quant, "engine": "default", "tokens": plan.prefill}
    for which in plan.prefill_runs:
        if budget.left() < 2 * row.get("cold_ms", 0) / 1e3 + 1:
            sec["skipped"].append(f"{quant} prefill {which}: budget")
            break
        with guarded(report, "decode", f"{quant} prefill {which}"):
            mark = clock.mark()
            # a new prompt each time: the prefix cache would serve a repeated one
            prompt = random_prompts(1, plan.prefill, plan.shape["vocab_size"], seed=7 if which == "cold" else 8)
            res = run_requests(engine, prompt, 1, seed=1, clock=clock)
            ms = 1e3 * sum(s["s"] for s in clock.steps[mark:] if not s["decode"])
            if ms <= 0:
                raise RuntimeError(f"no prefill step recorded: {clock.steps[mark:]}")
            row[f"{which}_ms"] = ms
            row["ttft_ms"] = 1e3 * res["ttft_s"]
    if "warm_ms" in row or "cold_ms" in row:
        row["ms"] = row.get("warm_ms", row.get("cold_ms"))
        row["tok_s"] = plan.prefill * 1e3 / row["ms"]
        sec["rows"].append(row)
        cold = f" (first one, kernels compiling: {row['cold_ms']:.0f} ms)" if "cold_ms" in row else ""
        log(f"prefill {quant} {plan.prefill} tokens: {row['ms']:.0f} ms = {row['tok_s']:.0f} tok/s{cold}")
        report.save()


def profile_counts(prof, steps: int, own_syncs: int) -> dict:
    """Per decode step: launches, synchronisations, copies, GPU kernels; the top kernels by GPU time."""
    ka = prof.key_averages()
    count: dict[str, int] = {}
    gpu_kernels, top = 0, []
    for e in ka:
        count[e.key] = count.get(e.key, 0) + e.count
        if CUDA and str(getattr(e, "device_type", "")).endswith("CUDA"):
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if not e.key.startswith(("Memcpy", "Memset")):
                gpu_kernels += e.count
                top.append((t, e.key, e.count))

    def total(pred) -> int:
        return sum(n for k, n in count.items() if pred(k))

    syncs = {k: count.get(k, 0) for k in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                                          "aten::item", "aten::_local_scalar_dense")}
    syncs["cudaDeviceSynchronize"] = max(0, syncs["cudaDeviceSynchronize"] - own_syncs)
    per = 1.0 / steps
    row = {"steps": steps,
           "launches": per * total(lambda k: "LaunchKernel" in k or k.startswith("cuLaunch")),
           "graph_launches": per * total(lambda k: k.startswith(("cudaGraphLaunch", "cuGraphLaunch"))),
           "gpu_kernels": per * gpu_kernels,
           "syncs": per * sum(v for k, v in syncs.items() if k.startswith("cuda")),
           "item": per * syncs["aten::item"],
           "local_scalar_dense": per * syncs["aten::_local_scalar_dense"],
           "memcpy_calls": per * total(lambda k: k.startswith(("cudaMemcpy", "cuMemcpy"))),
           "h2d": per * total(lambda k: k.startswith("Memcpy HtoD")),
           "d2h": per * total(lambda k: k.startswith("Memcpy DtoH")),
           "d2d": per * total(lambda k: k.startswith("Memcpy DtoD")),
           "aten_ops": per * total(lambda k: k.startswith("aten::")),
           "sync_detail": {k: v * per for k, v in syncs.items()}}
    top.sort(reverse=True)
    row["top_kernels"] = [{"name": k[:120], "us_per_step": t * per, "calls_per_step": n * per} for t, k, n in top[:10]]
    return row


def measure_profile(engine: NativeEngine, clock: StepClock, plan: Plan, label: str, out: Path, traces: bool,
                    budget: Budget, report: Report) -> None:
    sec = report.section("profile")
    vocab = plan.shape["vocab_size"]
    for b in plan.profile_batches:
        if budget.left() < 5:
            sec["skipped"].append(f"{label} batch {b}: budget")
            continue
        with guarded(report, "profile", f"{label} batch {b}"):
            want = clock.profile(b, plan.profile_steps, skip=WARM_STEPS)
            try:  # one decode step more than the window: the requests' loop must outlive the profiler's stop
                run_requests(engine, random_prompts(b, plan.prompt_len, vocab, seed=100 + b),
                             WARM_STEPS + plan.profile_steps + 2, seed=b, clock=clock)
            finally:
                clock._want = None
                if want.get("prof") is not None and not want.get("stopped"):  # a window left open
                    with contextlib.suppress(Exception):
                        want["prof"].stop()
            if want.get("prof") is None or want["done"] < plan.profile_steps:
                raise RuntimeError(f"only {want['done']} of {plan.profile_steps} decode steps profiled")
            row = {"engine": label, "batch": b, **profile_counts(want["prof"], want["done"], own_syncs=1 if CUDA else 0)}
            sec["rows"].append(row)
            log(f"profile {label} batch {b}: {row['launches']:.0f} launches, {row['graph_launches']:.1f} graph "
                f"launches, {row['gpu_kernels']:.0f} GPU kernels, {row['syncs']:.1f} syncs, "
                f"{row['memcpy_calls']:.1f} memcpy calls per step")
            if traces:
                want["prof"].export_chrome_trace(str(out / f"trace-{label}-b{b}.json"))


def engine_section(quant: str, plan: Plan, sections: set[str], report: Report, out: Path, traces: bool,
                   deadline: float) -> None:
    """Default then eager engine for one expert format: decode and prefill rows, and (MXFP8) the profile.
    On a GPU the eager engine serves the default one's model (two 30B models do not fit, and drawing and
    quantizing one again costs ~10 s); the first engine, its KV cache and its graphs are gone before."""
    budget = Budget(plan.budgets[f"decode-{quant}"], deadline)
    do_decode, do_profile = "decode" in sections, "profile" in sections and quant == "mxfp8"
    if not (do_decode or do_profile):
        return
    folder = scratch()
    (folder / "config.json").write_text(json.dumps(plan.shape))
    batches = plan.batches[quant] if do_decode else []
    max_seqs = max(batches + plan.profile_batches + [1])
    kv_tokens = max_seqs * (plan.prompt_len + max(plan.new_tokens.values()) + 16) + plan.prefill + 4096
    names = ["decode"] * do_decode + ["profile"] * do_profile
    model = None
    for label in ("default", "eager"):
        if budget.left() < 10:
            for n in names:
                report.section(n)["skipped"].append(f"{quant}/{label} engine: budget")
            continue
        with guarded(report, names[0], f"{quant}/{label} engine"):
            model = one_engine(folder, plan, quant, label, max_seqs, kv_tokens, model if CUDA else None,
                               do_decode, do_profile, budget, report, out, traces)
        free_memory()
    model = None
    free_memory()


def one_engine(folder: Path, plan: Plan, quant: str, label: str, max_seqs: int, kv_tokens: int, model,
               do_decode: bool, do_profile: bool, budget: Budget, report: Report, out: Path, traces: bool):
    """Start one engine, measure it, stop it; returns its model. Everything that holds the engine is a
    local here, so it can be freed when this returns."""
    name = "decode" if do_decode else "profile"
    t = time.perf_counter()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    engine = make_engine(folder, plan, quant, label == "eager", max_seqs, kv_tokens, model=model)
    try:
        up = time.perf_counter() - t
        info = {"experts": quant, "engine": label, "up_s": up, "describe": engine.describe(),
                "weights_gib": gib(engine.weight_bytes()), "kv_cache_gib": gib(engine.kv_cache_bytes)}
        if CUDA:  # peak against weights + KV cache: the dummy load must not hold the model twice
            info["gpu_allocated_gib"] = gib(torch.cuda.memory_allocated())
            info["gpu_peak_gib"] = gib(torch.cuda.max_memory_allocated())
        report.section(name).setdefault("engines", []).append(info)
        log(f"engine {quant}/{label} up in {up:.1f} s: {info['describe']}")
        clock = StepClock(engine)
        t = time.perf_counter()
        run_requests(engine, random_prompts(2, 32, plan.shape["vocab_size"], seed=0), 8, seed=0, clock=clock)
        log(f"engine {quant}/{label}: warm-up {time.perf_counter() - t:.1f} s")
        if do_decode:
            eager_batches = [b for b in plan.eager_batches if b in plan.batches[quant]]
            measure_decode(engine, clock, plan, quant, label, plan.batches[quant] if label == "default" else eager_batches,
                           budget, report)
            if label == "default" and quant in plan.prefill_experts:
                measure_prefill(engine, clock, plan, quant, budget, report)
        if do_profile:
            measure_profile(engine, clock, plan, label, out, traces, budget, report)
        return engine.model
    finally:
        stop_engine(engine)


# -- sections ----------------------------------------------------------------------------------------------


def section_parity(plan: Plan, report: Report, deadline: float) -> None:
    from transformers import AutoModelForCausalLM

    from serve.tiny import TinySpec, build_tiny_checkpoint

    budget = Budget(plan.budgets["parity"], deadline)
    sec, dev = report.section("parity"), plan.device
    spec = (TinySpec(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=16,
                     num_experts_per_tok=4) if CUDA else TinySpec())
    ckpt = build_tiny_checkpoint(scratch() / "tiny", spec=spec)
    sec["shape"] = {k: v for k, v in vars(spec).items() if isinstance(v, int | float)}
    n_new = plan.parity_tokens
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, spec.vocab_size - 24, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 120, (plan.parity_prompts,), generator=g)]

    def hf_model(dtype):
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(dev).eval()
        # no end-of-sequence: every greedy run makes exactly n_new tokens, as the engine's do (min_new_tokens
        # would instead forbid the EOS token, a choice the engine is free to make)
        model.generation_config.eos_token_id = None
        return model

    def hf_greedy(model) -> list[list[int]]:
        outs = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p], device=dev)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                     do_sample=False, pad_token_id=0)
                outs.append(out[0, len(p):].tolist())
        return outs

    def agreement(outs: list[list[int]], ref: list[list[int]]) -> dict:
        return {"seq_same": sum(o == r for o, r in zip(outs, ref, strict=True)), "seqs": len(ref),
                "tok_same": sum(sum(a == b for a, b in zip(o, r, strict=False)) for o, r in zip(outs, ref, strict=True)),
                "tokens": sum(len(r) for r in ref),
                "first_divergence": [next((i for i, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), len(r))
                                     for o, r in zip(outs, ref, strict=True)]}

    hf32 = hf_model(torch.float32)
    ref = hf_greedy(hf32)
    ids, split = prompts[0] + ref[0], len(prompts[0])
    with torch.no_grad():
        ref_logits = hf32(torch.tensor([ids], device=dev)).logits[0, split - 1:].float().cpu()
    del hf32
    with guarded(report, "parity", "transformers bf16"):
        hf16 = hf_model(torch.bfloat16)
        with torch.no_grad():
            l16 = hf16(torch.tensor([ids], device=dev)).logits[0, split - 1:].float().cpu()
        row = {"variant": "transformers bf16 (baseline)", "logit_gap": (l16 - ref_logits).abs().max().item(),
               **agreement(hf_greedy(hf16), ref)}
        sec["rows"].append(row)
        log(f"parity {row['variant']}: max |logit gap| {row['logit_gap']:.3e}, greedy {row['seq_same']}/{row['seqs']}")
        del hf16
    for dtype, quant in (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "mxfp8"), ("float32", "mxfp8")):
        name = f"engine {dtype}/{quant}"
        if budget.left() < 3:
            sec["skipped"].append(f"{name}: budget")
            continue
        with guarded(report, "parity", name):
            t = time.perf_counter()
            engine = NativeEngine(str(ckpt), EngineConfig(device=dev, dtype=dtype, quant=quant, kv_cache_tokens=16384))
            try:
                logits = forced_logits(engine, ids, split).float().cpu()
                outs = generate_greedy(engine, prompts, n_new)
            finally:
                stop_engine(engine)
            row = {"variant": name, "logit_gap": (logits - ref_logits).abs().max().item(), **agreement(outs, ref),
                   "seconds": time.perf_counter() - t}
            sec["rows"].append(row)
            log(f"parity {name}: max |logit gap| vs transformers fp32 {row['logit_gap']:.3e}, greedy sequences "
                f"{row['seq_same']}/{row['seqs']}, tokens {row['tok_same']}/{row['tokens']}")
        free_memory()
    table("parity: against transformers float32 on a tiny random checkpoint (logits over "
          f"{len(ids) - split + 1} positions; greedy {plan.parity_prompts} prompts x {n_new} tokens)", sec["rows"],
          [("variant", "variant", ""), ("logit_gap", "max|logit gap|", ".3e"), ("seq_same", "same seqs", "d"),
           ("tok_same", "same tokens", "d"), ("tokens", "of", "d")])


def generate_greedy(engine: NativeEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    async def one(p):
        return [t.id async for t in engine.generate(p, SamplingParams(max_tokens=n, temperature=0.0))]

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(main())


def section_decode(plan: Plan, sections: set[str], report: Report, out: Path, traces: bool, deadline: float) -> None:
    for quant in ("mxfp8", "none"):
        if quant == "none" and "decode" not in sections:
            continue
        engine_section(quant, plan, sections, report, out, traces, deadline)
    if "decode" in sections:
        rows = report.section("decode")["rows"]
        new = ", ".join(f"{k} {v}" for k, v in plan.new_tokens.items())
        table(f"decode: {plan.layers} layers, prompts of {plan.prompt_len} tokens, new tokens each: {new} "
              f"(median over decode steps after {WARM_STEPS})", [r for r in rows if r["kind"] == "decode"],
              [("experts", "experts", ""), ("engine", "engine", ""), ("batch", "batch", "d"),
               ("step_ms", "step ms", ".2f"), ("interval_ms", "interval ms", ".2f"), ("tok_s", "tok/s", ".1f"),
               ("tok_s_per_seq", "tok/s/seq", ".1f"), ("ttft_ms", "first token ms", ".0f")])
        table("prefill", [r for r in rows if r["kind"] == "prefill"],
              [("experts", "experts", ""), ("tokens", "tokens", "d"), ("ms", "ms", ".0f"), ("tok_s", "tok/s", ".0f"),
               ("cold_ms", "first (cold) ms", ".0f")])
        graph_gain(rows)
    if "profile" in sections:
        table("profile: per decode step (MXFP8 experts)", report.section("profile")["rows"],
              [("engine", "engine", ""), ("batch", "batch", "d"), ("launches", "launches", ".0f"),
               ("graph_launches", "graph launches", ".1f"), ("gpu_kernels", "GPU kernels", ".0f"),
               ("syncs", "syncs", ".1f"), ("item", "item()", ".1f"), ("memcpy_calls", "memcpy calls", ".1f"),
               ("h2d", "H2D", ".1f"), ("d2h", "D2H", ".1f"), ("d2d", "D2D", ".1f"), ("aten_ops", "aten ops", ".0f")])
        for r in report.section("profile")["rows"][:1]:
            if r.get("top_kernels"):
                table(f"top GPU kernels, {r['engine']} engine, batch {r['batch']}", r["top_kernels"],
                      [("us_per_step", "us/step", ".1f"), ("calls_per_step", "calls/step", ".1f"), ("name", "kernel", "")])


def graph_gain(rows: list[dict]) -> None:
    """The default engine's decode step against the eager one's, same experts and batch."""
    if not CUDA:
        print("(no CUDA graphs on a CPU: the default and eager engines run the same code; any gap is noise)",
              flush=True)
    eager = {(r["experts"], r["batch"]): r for r in rows if r["kind"] == "decode" and r["engine"] == "eager"}
    for r in rows:
        e = eager.get((r["experts"], r["batch"])) if r["kind"] == "decode" and r["engine"] == "default" else None
        if e is not None:
            r["speedup_vs_eager"] = e["interval_ms"] / r["interval_ms"]
            print(f"default vs eager, experts {r['experts']} batch {r['batch']}: {r['speedup_vs_eager']:.2f}x "
                  f"({e['interval_ms']:.2f} -> {r['interval_ms']:.2f} ms per step)", flush=True)


def section_hf(plan: Plan, report: Report, deadline: float) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, StoppingCriteria, StoppingCriteriaList

    budget = Budget(plan.budgets["hf"], deadline)
    sec, dev, s = report.section("hf"), plan.device, plan.shape
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
            "norm_topk_prob", "rms_norm_eps", "max_position_embeddings")
    cfg = Qwen3MoeConfig(**{k: s[k] for k in keys}, rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]})
    t = time.perf_counter()
    with torch.device(dev):  # random weights drawn on the device: no checkpoint, no host copy
        model = Qwen3MoeForCausalLM._from_config(cfg, dtype=torch.bfloat16, experts_implementation="grouped_mm").eval()
    sec["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    log(f"transformers model ({sec['experts_implementation']}) made in {time.perf_counter() - t:.1f} s")

    class Stamp(StoppingCriteria):
        """Called once per generated token: its time, synchronised. Never stops anything."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            sync()
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(ids, n: int) -> list[float]:
        stamp = Stamp()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([stamp]))
        return stamp.times

    try:
        last = 0.0
        for b in plan.hf_batches:
            if budget.left() < (plan.new_tokens["mxfp8"] + 4) * last * 1.5:
                sec["skipped"].append(f"batch {b}: budget")
                continue
            with guarded(report, "hf", f"batch {b}"):
                ids = torch.tensor(random_prompts(b, plan.prompt_len, s["vocab_size"], seed=b), device=dev)
                generate(ids, 2)  # warm-up
                sync()
                t = time.perf_counter()
                times = generate(ids, plan.new_tokens["mxfp8"])
                gaps = [y - x for x, y in zip(times, times[1:], strict=False)][1:]
                step = statistics.median(gaps)
                last = step
                row = {"batch": b, "step_ms": 1e3 * step, "tok_s": b / step, "first_token_ms": 1e3 * (times[0] - t),
                       "decode_steps": len(gaps)}
                sec["rows"].append(row)
                log(f"transformers batch {b}: {row['step_ms']:.2f} ms/step = {row['tok_s']:.1f} tok/s")
    finally:
        model = None  # 60 GB at the full shape: gone before the next section
        free_memory()
    table(f"transformers generate ({sec['experts_implementation']} experts, bf16): {plan.layers} layers, prompts of "
          f"{plan.prompt_len} tokens", sec["rows"],
          [("batch", "batch", "d"), ("step_ms", "ms/step", ".2f"), ("tok_s", "tok/s", ".1f"),
           ("first_token_ms", "first token ms", ".0f")])


def section_spec(plan: Plan, report: Report, deadline: float) -> None:
    import gpu_spec

    sec = report.section("spec")
    budget = Budget(plan.budgets["spec"], deadline)
    batches = [1, 8, 32] if CUDA else [1, 4]
    queries = gpu_spec.QUERIES if CUDA and not plan.quick else (1, 2, 4, 8)
    folder = scratch()
    (folder / "config.json").write_text(json.dumps(plan.shape))
    kv_tokens = max(batches) * (plan.prompt_len + max(queries) + 32) + 4096
    engine = make_engine(folder, plan, "mxfp8", False, max(batches), kv_tokens, spec_tokens=max(queries) - 1)
    try:
        costs = gpu_spec.verify_costs(engine, batches, queries, plan.prompt_len, plan.shape["vocab_size"], budget.left)
    finally:
        stop_engine(engine)
    sec["rows"] += [{"kind": "verify", **r} for r in costs]
    table("verify step: ms by query tokens per sequence (MXFP8 experts" + (", CUDA graphs)" if CUDA else ")"), costs,
          [("batch", "batch", "d"), ("query_tokens", "q", "d"), ("step_ms", "ms", ".2f"), ("vs_decode", "x decode", ".2f")])
    # two acceptance sources: the adaptive run (its drafts sized by a CPU's verify cost: short) and the
    # --fixed one (every proposal verified up to K: what longer, GPU-priced drafts accept)
    results = ROOT / "bench" / "spec-results"
    proj = []
    # the newest replays (with the one-token fallback: fallback/replay/), adaptive and fixed-length
    for name in ("fallback/replay/spec.json", "fallback/replay/spec-fixed.json"):
        proj += [{"source": name, **r} for r in gpu_spec.projections(costs, gpu_spec.acceptance(results / name))]
    sec["rows"] += [{"kind": "projection", **r} for r in proj]
    if proj:
        table("speedup PROJECTED from the CPU replay's acceptance (bench/spec.py; random weights accept nothing)",
              proj, [("source", "acceptance from", "s"), ("set", "set", "s"), ("batch", "batch", "d"), ("tokens_per_forward", "tok/fwd", ".2f"),
                     ("mean_draft", "draft", ".1f"), ("verify_vs_decode", "verify/decode", ".2f"),
                     ("projected_speedup", "speedup", ".2f")])
    else:
        sec["skipped"].append("projection: bench/spec-results/ has no acceptance figures (run bench/spec.py)")


def load_kernel_bench():
    """bench/kernels.py as a module (its name would clash with the kernels package)."""
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    before = os.environ.get("TRITON_INTERPRET")
    spec.loader.exec_module(mod)
    # it turns the Triton interpreter on where there is no GPU, and backend="auto" would then run the
    # kernels through it on a CPU (minutes): the CPU rows here are the torch paths a CPU server runs
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    return mod


def section_kernels(plan: Plan, report: Report, deadline: float) -> None:
    from kernels import quantize_mxfp8

    budget = Budget(plan.budgets["kernels"], deadline)
    kb, sec, dev = load_kernel_bench(), report.section("kernels"), torch.device(plan.device)
    if plan.reduced:  # its functions read these module constants: a small layer, in seconds on a CPU
        kb.E, kb.TOP_K = REDUCED["num_experts"], REDUCED["num_experts_per_tok"]
        kb.D, kb.INTER = REDUCED["hidden_size"], REDUCED["moe_intermediate_size"]
    reps = 100 if CUDA else 3
    backend = "triton" if CUDA else "torch"
    problem = kb.grouped_mm_problem(dev)  # None: the bf16 baseline is torch's grouped_mm
    sec["shape"] = {"experts": kb.E, "top_k": kb.TOP_K, "hidden": kb.D, "intermediate": kb.INTER,
                    "mxfp8_path": "Triton kernel" if CUDA else "torch reference (CPU)",
                    "bf16_path": "grouped_mm" if problem is None else f"per-expert loop ({problem})"}
    copy_bw = kb.copy_bandwidth(dev, (1 << 30) if CUDA else (1 << 26), reps)
    sec["copy_gb_s"] = copy_bw / kb.GB
    log(f"kernels: copy bandwidth {copy_bw / kb.GB:.1f} GB/s")
    # activations of T tokens, then one layer's w13 (what a load quantizes)
    for rows in [*plan.kernel_tokens, kb.E * 2 * kb.INTER]:
        with guarded(report, "kernels", f"quantizer {rows}"):
            x = torch.randn(rows, kb.D, device=dev).to(torch.bfloat16)
            t = kb.timed(lambda x=x: quantize_mxfp8(x, backend=backend), dev, reps)
            nbytes = x.numel() * (2 + 1 + 1 / 32)
            sec["rows"].append({"kind": "quantizer", "rows": rows, "ms": t * 1e3, "gb_s": nbytes / t / kb.GB,
                                "pct_copy": 100 * nbytes / t / copy_bw})
            x = None
    w13, w2 = kb.expert_weights(dev)
    q13, q2 = kb.quantize_experts(w13, backend), kb.quantize_experts(w2, backend)
    for T in plan.kernel_tokens:
        if budget.left() < 2:
            sec["skipped"].append(f"moe {T}: budget")
            continue
        with guarded(report, "kernels", f"moe {T}"):
            row = kb.moe_row(T, dev, copy_bw, reps, w13, w2, q13, q2, backend, grouped_problem=problem)
            sec["rows"].append(row)
            log(f"kernels: moe T={T}: bf16 grouped_mm {row['bf16_ms']:.3f} ms, bf16 loop "
                f"{row['bf16_loop_ms']:.3f} ms, mxfp8 {row['mxfp8_ms']:.3f} ms ({row['speedup']:.2f}x)")
    w13 = w2 = q13 = q2 = None
    free_memory()
    if CUDA and budget.left() > 5:  # each decode MoE kernel alone, in a graph (the CPU runs torch paths here)
        with guarded(report, "kernels", "moe kernel bandwidth"):
            import gpu_tune

            bw = gpu_tune.bandwidth_report(copy_bw=copy_bw, log=log)
            sec["rows"] += bw["rows"]
            sec["errors"] += [f"bandwidth: {f}" for f in bw["failed"]]
            free_memory()
    table(f"quantizer ({backend}), rceil, bf16 [rows, {kb.D}] -> fp8 + E8M0; copy bandwidth {copy_bw / kb.GB:.1f} GB/s",
          [r for r in sec["rows"] if r["kind"] == "quantizer"],
          [("rows", "rows", "d"), ("ms", "ms", ".4f"), ("gb_s", "GB/s", ".1f"), ("pct_copy", "% copy", ".1f")])
    gmm = "bf16 per-expert loop (no grouped_mm: " + problem + ")" if problem else "bf16 grouped_mm (gmm)"
    table(f"MoE layer E={kb.E} top-{kb.TOP_K} D={kb.D} I={kb.INTER}: MXFP8 {sec['shape']['mxfp8_path']} vs {gmm}; "
          "loop = bf16 per-expert loop; %roof: active experts' bytes / copy bandwidth; TF/s: 2*3*T*K*D*I / time",
          [r for r in sec["rows"] if r["kind"] == "moe"], kb.MOE_COLUMNS)
    bandwidth_table([r for r in sec["rows"] if r["kind"] == "moe_kernel"])


def bandwidth_table(rows: list[dict]) -> None:
    if rows:
        table("decode MoE kernels alone in a CUDA graph: expert codes + scales read / device time (issue 51: >= 60% "
              "of copy)", rows, [("tokens", "T", "d"), ("kernel", "kernel", ""), ("which", "config", ""),
                                 ("us", "us", ".1f"), ("expert_mb", "MB", ".1f"), ("gb_s", "GB/s", ".0f"),
                                 ("pct_copy", "% copy", ".1f")])


def section_tune(plan: Plan, report: Report, out: Path) -> None:
    """--tune: bench/gpu_tune.py's sweep; on a GPU the table goes to kernels/tuned/ (commit it) and a copy to --out,
    else to --out only."""
    import gpu_tune

    from kernels.backend import interpreting

    sec = report.section("tune")
    if not CUDA and not interpreting():
        sec["skipped"].append("on a CPU the sweep runs the Triton kernels only under TRITON_INTERPRET=1 "
                              "(tests/kernels/test_tuning.py runs it at a tiny shape)")
        log("tune: skipped (no GPU, no interpreter)")
        return
    res = gpu_tune.run(budget_s=TUNE_BUDGET, folder=None if CUDA else out, log=log)
    if CUDA:  # a copy beside the JSON too: --out is what a lent machine hands back
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(res["table"], out / Path(res["table"]).name)
    sec["rows"] += res["rows"]
    sec["skipped"] += res["skipped"]
    sec["table"], sec["copy_gb_s"], sec["failed_candidates"] = res["table"], res["copy_gb_s"], res["failed"]
    table("tune: the MoE layer in a CUDA graph, today's path against the best variant (written if faster)",
          [r for r in sec["rows"] if r["kind"] == "moe_layer"],
          [("tokens", "T", "d"), ("default_path", "today", ""), ("default_us", "today us", ".1f"),
           ("best", "best variant", ""), ("best_us", "best us", ".1f"), ("chosen", "written", ""),
           ("speedup", "speedup", ".2f")])
    bandwidth_table([r for r in sec["rows"] if r["kind"] == "moe_kernel"])
    table("tune: FP8 W8A16 kernel (today's tiles vs the best)", [r for r in sec["rows"] if r["kind"] == "fp8"],
          [("layer", "layer", ""), ("M", "M", "d"), ("default_us", "today us", ".1f"), ("best_us", "best us", ".1f"),
           ("chosen", "written", ""), ("gb_s", "GB/s", ".0f")])
    png = gpu_tune.plot(sec["rows"], out / ("tune.png" if CUDA else "tune-cpu-interpreter.png"),
                        f"{report.data['meta'].get('device', '')}: bench/gpu.py --tune")
    sec["plot"] = None if png is None else str(png)
    print(f"table: {res['table']} ({len(res['failed'])} candidates could not run; see the JSON); plot: {png}", flush=True)


def section_fp8(plan: Plan, report: Report, deadline: float) -> None:
    import gpu_fp8

    budget = Budget(plan.budgets["fp8"], deadline)
    kb, sec, dev = load_kernel_bench(), report.section("fp8"), torch.device(plan.device)
    reps = 50 if CUDA else 3
    copy_bw = kb.copy_bandwidth(dev, (1 << 30) if CUDA else (1 << 26), reps)
    sec["shape"] = {"copy_gb_s": copy_bw / 1e9, "fp8_path": "Triton W8A16 kernel" if CUDA else "torch reference (CPU)",
                    "layers": [list(s) for s in gpu_fp8.dense_shapes(plan.shape)]}
    with guarded(report, "fp8", "kernels"):
        rows = gpu_fp8.kernel_rows(plan.shape, [1, 8, 32, 64, plan.prefill] if CUDA else [1, 8, 64], dev,
                                   lambda f: kb.timed(f, dev, reps), copy_bw, lambda: budget.left() - 30 * CUDA)
        sec["rows"] += rows
        table(f"FP8 W8A16 ({sec['shape']['fp8_path']}) vs bf16 F.linear; % copy: weight bytes / time / copy bandwidth",
              rows, [("layer", "layer", "s"), ("M", "rows", "d"), ("bf16_ms", "bf16 ms", ".4f"), ("fp8_ms", "fp8 ms", ".4f"),
                     ("speedup", "x", ".2f"), ("fp8_pct_copy", "fp8 %copy", ".1f"), ("bf16_pct_copy", "bf16 %copy", ".1f"),
                     ("max_rel_err", "rel err", ".1e")])
    folder = scratch()
    (folder / "config.json").write_text(json.dumps(plan.shape))
    batches = [1, 8, 32] if CUDA else [1, 4]
    kv_tokens = max(batches) * (plan.prompt_len + 64) + 4096
    ids = random_prompts(1, 64 if CUDA else 24, plan.shape["vocab_size"], seed=5)[0]
    logits = {}
    for qd in ("none", "fp8"):
        if budget.left() < 5:
            sec["skipped"].append(f"engine quant_dense={qd}: budget")
            continue
        with guarded(report, "fp8", f"engine quant_dense={qd}"):
            engine = make_engine(folder, plan, "mxfp8", False, max(batches), kv_tokens, quant_dense=qd)
            try:
                sec.setdefault("engines", []).append({"quant_dense": qd, "describe": engine.describe(),
                                                      "weights_gib": gib(engine.weight_bytes())})
                logits[qd] = forced_logits(engine, ids, 8).float().cpu()
                clock = StepClock(engine)
                run_requests(engine, random_prompts(2, 32, plan.shape["vocab_size"], seed=0), 8, seed=0, clock=clock)
                for b in batches:
                    mark = clock.mark()
                    res = run_requests(engine, random_prompts(b, plan.prompt_len, plan.shape["vocab_size"], seed=b),
                                       plan.new_tokens["mxfp8"], seed=b, clock=clock)
                    row = {"kind": "decode", "quant_dense": qd, **decode_row(clock, mark, b, res)}
                    sec["rows"].append(row)
                    log(f"fp8: quant_dense={qd} batch {b}: step {row['step_ms']:.2f} ms = {row['tok_s']:.0f} tok/s")
            finally:
                stop_engine(engine)
        free_memory()
    if len(logits) == 2:
        gap = gpu_fp8.logit_gap(logits["none"], logits["fp8"])
        sec["rows"].append(gap)
        log(f"fp8: logits, quant_dense fp8 vs none over {gap['positions']} positions: max |d| {gap['max_abs']:.3f}, "
            f"mean {gap['mean_abs']:.4f} (logit std {gap['logit_std']:.3f}), greedy agreement {gap['greedy_agree']:.2f}")
    table("decode with FP8 dense layers vs bf16 (MXFP8 experts" + (", CUDA graphs)" if CUDA else ")"),
          [r for r in sec["rows"] if r["kind"] == "decode"],
          [("quant_dense", "dense", "s"), ("batch", "batch", "d"), ("step_ms", "step ms", ".2f"), ("tok_s", "tok/s", ".0f")])


# -- main --------------------------------------------------------------------------------------------------


def section_train(plan: Plan, report: Report, deadline: float) -> None:
    """One trainer step at the 4-layer Qwen3-30B-A3B shape (bench/train_step.py; the reduced shape on a CPU),
    after checking the grouped-GEMM expert backward against autograd through the reference on this device."""
    import importlib.util

    from kernels.moe_grouped import grouped_available, moe_backward
    from kernels.moe_reference import moe_reference

    sec = report.section("train")
    dev = plan.device
    dtype = torch.bfloat16 if CUDA else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    T, E, K, D, inter = (4096, 128, 8, 2048, 768) if CUDA else (256, 16, 4, 128, 64)
    x = torch.randn(T, D, device=dev, generator=g).to(dtype)
    ids = torch.randn(T, E, device=dev, generator=g).topk(K, -1).indices
    w = torch.rand(T, K, device=dev, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, D, device=dev, generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, inter, device=dev, generator=g) / inter**0.5).to(dtype)
    grad = torch.randn(T, D, device=dev, generator=g).to(dtype)
    grouped = grouped_available(dtype, torch.device(dev))
    ours = moe_backward(grad, x, ids, w, w13, w2, grouped=grouped)
    fused = moe_backward(grad, x, ids, w, w13, w2, grouped=grouped, variant="fused")
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    moe_reference(leaves[0], ids, leaves[1], leaves[2], leaves[3]).backward(grad)
    err = {name: float((a.float() - b.grad.float()).abs().max() / b.grad.float().abs().max())
           for name, a, b in zip(("x", "weights", "w13", "w2"), ours, leaves, strict=True)}
    err_fused = {name: float((a.float() - b.grad.float()).abs().max() / b.grad.float().abs().max())
                 for name, a, b in zip(("x", "weights", "w13", "w2"), fused, leaves, strict=True)}
    sync()
    times = {}
    for name, flag, variant in (("grouped", grouped, "grouped"), ("fused", grouped, "fused"), ("loop", False, "grouped")):
        if name != "loop" and not grouped:
            continue
        moe_backward(grad, x, ids, w, w13, w2, grouped=flag, variant=variant)
        sync()
        t = time.perf_counter()
        for _ in range(3):
            moe_backward(grad, x, ids, w, w13, w2, grouped=flag, variant=variant)
        sync()
        times[name] = (time.perf_counter() - t) / 3
    check = {"kind": "expert_backward", "tokens": T, "experts": E, "top_k": K, "grouped_mm": grouped,
             "max_rel_err": err, "max_rel_err_fused": err_fused, "seconds": times}
    sec["rows"].append(check)
    log(f"expert backward ({'grouped GEMM' if grouped else 'per-expert loop'}): max relative error vs autograd "
        f"{max(err.values()):.2e} (fused variant {max(err_fused.values()):.2e}); seconds {times}")
    del x, ids, w, w13, w2, grad, ours, fused, leaves
    free_memory()
    spec = importlib.util.spec_from_file_location("bench_train_step", ROOT / "bench" / "train_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kw = dict(layers=4, seqs=8, length=2048) if CUDA else dict(layers=2, seqs=4, length=256)
    # the default with and without checkpointing, then each trainer option of bench/train_step.py (OPTIONS)
    # beside it in the same run; on a GPU the non-checkpointed runs add a profiled step (their top ops)
    # (on a CPU the options' kernels fall back to the same torch ops: only the default pair runs there)
    runs = [("default", False), ("default", True)] + [(o, False) for o in mod.OPTIONS if o != "default" and CUDA]
    for option, ckpt in runs:
        if time.perf_counter() > deadline:
            sec["skipped"].append(f"{option}{' checkpointed' if ckpt else ''}: the run's budget is spent")
            continue
        result = mod.measure("qwen3-30b-a3b" if CUDA else "reduced", micro_batch_tokens=4096, steps=3,
                             activation_checkpointing=ckpt, log=log, option=option, profile=CUDA and not ckpt, **kw)
        sec["rows"].append({"kind": "step"} | {k: v for k, v in result.items() if k != "plan"})
        free_memory()


def section_rl(plan: Plan, report: Report) -> None:
    """Colocated RL steps (bench/gpu_rl.py): on a CPU one step at its tiny shape, to check the section runs."""
    import gpu_rl

    sec = report.section("rl")
    result = gpu_rl.measure(layers=None if CUDA else plan.layers, steps=3 if CUDA else 1,
                            group_size=4 if CUDA else 2, log=log)
    sec["shape"] = {"config": result["shape"], "layers_tried": result["layers_tried"], "engine": result["engine"],
                    "plan": result["plan"], "build_s": result["build_s"], "loop_s": result["loop_s"]}
    sec["rows"] += [{"kind": "step"} | r for r in result["steps"]]
    sec["rows"].append({"kind": "hand_over"} | result["hand_over"])
    sec["rows"].append({"kind": "median"} | result["median"])
    table("colocated RL steps (engine and trainer on one device)", [r for r in sec["rows"] if r["kind"] == "step"],
          [("step", "step", "d"), ("rollout_s", "rollout s", ".2f"), ("rollout_tok_s", "compl tok/s", ".1f"),
           ("train_s", "train s", ".2f"), ("train_tok_s", "train tok/s", ".1f"), ("sleep_s", "KV free s", ".4f"),
           ("hand_over_s", "hand-over s", ".4f"), ("wake_s", "KV back s", ".4f"), ("step_s", "step s", ".2f")])
    h = result["hand_over"]
    log(f"hand-over: in memory {h['memory_s']:.4f} s, through the disk {h['disk_s']:.3f} s "
        f"(save {h['disk_save_s']:.3f} + load {h['disk_load_s']:.3f}); {h['disk_over_memory']}x")


def section_invariant(plan: Plan, report: Report, deadline: float) -> None:
    import gpu_invariant

    gpu_invariant.section(sys.modules[__name__], plan, report, deadline)


def section_tests(plan: Plan, report: Report, deadline: float) -> None:
    """pytest on GPU_TEST_FILES in a child process (a crash in one test cannot end the benchmark), within
    the section's budget: passed/failed/skipped counts and each failure's test id and last error line."""
    import re
    import subprocess

    sec = report.section("tests")
    files = list(GPU_TEST_FILES if CUDA else GPU_TEST_FILES[:1])
    limit = max(10.0, min(plan.budgets["tests"], deadline - time.perf_counter()))
    # as a user runs them: no Triton interpreter on a GPU, and pytest's plugins loaded (a caller that ran
    # train/recipe.py's episodes in this process set PYTEST_DISABLE_PLUGIN_AUTOLOAD, for its task repos)
    drop = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS"} | ({"TRITON_INTERPRET"} if CUDA else set())
    env = {k: v for k, v in os.environ.items() if k not in drop}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE", "--tb=line",
           *files]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", "60"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")), None
        sec["skipped"].append(f"pytest ran past the section's {limit:.0f} s: counts are of the tests that finished")
    summary = [line for line in out.splitlines()
               if re.search(r"\b(passed|failed|skipped|errors?)\b.* in [\d.]+s", line)]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary[-1])} \
        if summary else {}
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", out, flags=re.M)
    row = {"kind": "pytest", "files": files, "returncode": rc, "passed": counts.get("passed", 0),
           "failed": counts.get("failed", 0), "skipped": counts.get("skipped", 0),
           "errors": counts.get("error", 0) + counts.get("errors", 0),
           "failures": [{"test": t, "error": (m or "")[:300]} for t, m in failures], "tail": out[-2000:]}
    if rc is not None and rc < 0:
        row["crashed"] = f"pytest died of signal {-rc}"
    sec["rows"].append(row)
    log(f"tests: {row['passed']} passed, {row['failed']} failed, {row['skipped']} skipped, {row['errors']} errors"
        + (f"; {row['crashed']}" if "crashed" in row else "") + (f"; rc {rc}" if rc not in (0, None) else ""))
    for f in row["failures"]:
        log(f"  FAILED {f['test']}: {f['error'][:200]}")
    if rc != 0:
        sec["errors"].append(f"pytest rc {rc}: {row['failed']} failed, {row['errors']} errors"
                             + (f" ({row['crashed']})" if "crashed" in row else ""))


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing package is a fact to record, not a failure
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)} (default all)")
    p.add_argument("--layers", type=int, help="layers of the Qwen3-30B-A3B shape (default 48; reduced CPU shape: 2)")
    p.add_argument("--quick", action="store_true", help="fewer batches, tokens and kernel sizes")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "gpu-results", help="folder for the JSON (and traces)")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default: the sum of the sections' budgets)")
    p.add_argument("--traces", action="store_true", help="also write the profiled steps as Chrome traces")
    p.add_argument("--threads", type=int, default=2, help="CPU mode: torch threads (default 2)")
    p.add_argument("--tune", action="store_true",
                   help="first sweep the decode kernels' configurations and write this GPU's table to kernels/tuned/")
    args = p.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if unknown := sections - set(SECTIONS) - set(OPT_IN):
        p.error(f"unknown sections: {', '.join(sorted(unknown))} (known: {', '.join(SECTIONS + OPT_IN)})")
    plan = Plan(args)
    if not CUDA:
        torch.set_num_threads(args.threads)
    deadline = T0 + (args.budget or sum(plan.budgets.values()) + 15 + (TUNE_BUDGET + 30) * args.tune)
    date = time.strftime("%Y-%m-%d")
    path = args.out / (f"gpu-{date}.json" if CUDA else f"gpu-{date}-cpu-reduced.json")
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "versions": versions(), "reduced_cpu_shape": plan.reduced,
            "shape": plan.shape, "sections": sorted(sections, key=(SECTIONS + OPT_IN).index), "quick": args.quick,
            "prompt_len": plan.prompt_len, "new_tokens": plan.new_tokens, "prefill_tokens": plan.prefill,
            "warm_steps_dropped": WARM_STEPS, "tune": args.tune}
    if CUDA:
        meta["device"] = torch.cuda.get_device_name()
        meta["capability"] = "sm_" + "".join(map(str, torch.cuda.get_device_capability()))
        meta["gpu_memory_gib"] = gib(torch.cuda.get_device_properties(0).total_memory)
    else:
        meta["device"] = f"CPU only ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
        meta["torch_threads"] = torch.get_num_threads()
    report = Report(path, meta)
    v = meta["versions"]
    print(f"# bench/gpu.py  device: {meta['device']}  torch {v['torch']}  triton {v['triton']}  "
          f"transformers {v['transformers']}", flush=True)
    if plan.reduced:
        print("REDUCED CPU SHAPE: no CUDA device. Every section runs a small shape (2 layers, hidden 128, 8 experts "
              "top-2, vocabulary 1024) to check that the benchmark runs; no figure here says anything about a GPU.",
              flush=True)
    else:
        print(f"Qwen3-30B-A3B shape, {plan.layers} layers, random weights made on the device", flush=True)
        from kernels import tuning

        table = tuning.load()
        meta["tuned_table"] = None if table is None else str(tuning.table_path(table.device))
        if table is None and not args.tune:
            print(f"no tuned table for {meta['device']} ({tuning.table_path(meta['device'])}): the kernels run their "
                  "defaults; `--tune` sweeps and writes one first (~4 minutes)", flush=True)

    def run(name: str, fn) -> None:
        sec = report.section(name)
        if time.perf_counter() > deadline:
            sec["status"] = "skipped"
            sec["skipped"].append("the run's budget is spent")
            report.save()
            return
        log(f"=== {name}")
        t = time.perf_counter()
        try:
            fn()
            sec["status"] = "ok" if not sec["errors"] else "partial" if sec["rows"] else "error"
        except Exception as e:  # noqa: BLE001 - one section failing must not stop the others
            traceback.print_exc()
            sec["errors"].append(f"{type(e).__name__}: {e}"[:1000])
            sec["status"] = "partial" if sec["rows"] else "error"
            log(f"{name} FAILED: {type(e).__name__}: {e}")
        finally:
            sec["seconds"] += time.perf_counter() - t
            report.save()
            free_memory()

    if args.tune:  # first: the sections after it run with the table it writes
        run("tune", lambda: section_tune(plan, report, args.out))
    if "parity" in sections:
        run("parity", lambda: section_parity(plan, report, deadline))
    if sections & {"decode", "profile"}:
        engines = [n for n in ("decode", "profile") if n in sections]
        t = time.perf_counter()
        run(engines[0], lambda: section_decode(plan, sections, report, args.out, args.traces, deadline))
        if len(engines) == 2:  # measured together on the same engines: the status of both
            prof = report.section("profile")
            prof["status"] = "ok" if not prof["errors"] and prof["rows"] else "partial" if prof["rows"] else "error"
            prof["seconds"], prof["shared_with"] = 0.0, "decode"
            report.section("decode")["seconds"] = time.perf_counter() - t
            report.save()
    if "hf" in sections:
        run("hf", lambda: section_hf(plan, report, deadline))
    if "spec" in sections:
        run("spec", lambda: section_spec(plan, report, deadline))
    if "kernels" in sections:
        run("kernels", lambda: section_kernels(plan, report, deadline))
    if "fp8" in sections:
        run("fp8", lambda: section_fp8(plan, report, deadline))
    if "train" in sections:
        run("train", lambda: section_train(plan, report, deadline))
    if "rl" in sections:
        run("rl", lambda: section_rl(plan, report))
    if "invariant" in sections:
        run("invariant", lambda: section_invariant(plan, report, deadline))
    if "tests" in sections:
        run("tests", lambda: section_tests(plan, report, deadline))

    print("\n## summary", flush=True)
    for name, sec in report.data["sections"].items():
        took = "with decode" if sec.get("shared_with") else f"{sec['seconds']:.0f} s"
        extra = "; ".join(sec["errors"] + sec["skipped"])
        print(f"{name:8s} {sec['status']:8s} {took}" + (f"  ({extra[:300]})" if extra else ""), flush=True)
    print(f"total {time.perf_counter() - T0:.0f} s; wrote {path}", flush=True)
    return 0 if all(s["status"] == "ok" for s in report.data["sections"].values()) else 1


if __name__ == "__main__":
    try:
        code = main()
    finally:
        for folder in _SCRATCH:
            shutil.rmtree(folder, ignore_errors=True)
    sys.exit(code)
