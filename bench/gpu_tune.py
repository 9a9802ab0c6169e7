"""bench/gpu.py --tune (issue 51, items 5 and 1): sweep the decode kernels' launch configurations at the
Qwen3-30B-A3B decode step's shapes on this GPU, write the winners to its table (kernels/tuned/<device>.json,
which the kernels read at start-up: kernels/tuning.py), and report each MoE kernel's bandwidth in a graph.

What is swept, at the exact shapes a decode step launches (D 2048, I 768, 128 experts top-8, bf16):
- the MoE layer at T = 1, 8, 32, 16, 64 tokens (batch, and speculative verification's 16-64): today's path
  (the decode kernels up to 16 tokens, the grouped kernels above) against kernels/moe_decode_variants.py's
  variants: dot / swap-AB / broadcast-FMA multiply, split-K over D for gate_up, and each kernel's tiles.
  gate_up is swept first (per variant and split), then the fused kernel (gate_up, SwiGLU and down in one
  launch, plus the sum of its per-slice partials) as whole layers, then down for the best gate_up of each;
  the fastest of the pairs and the fused layers is timed as a whole layer against today's path and checked
  against its output; it is written only if it is faster (else the entry says "default", which keeps
  today's path).
- the W8A16 FP8 kernel (kernels/fp8_linear_triton.py, --quant-dense fp8) at the q/k/v, o and LM-head
  shapes for 1-64 rows: BLOCK_N, split-K, warps/stages against today's `tiles` guess.

Timing: each candidate's launches are captured in one CUDA graph, REPEAT launches over several copies of
the weights in turn (one layer's ~25 MB of active experts would otherwise stay in the 50 MB L2 between
launches and flatter the figure), replayed; seconds per launch = median replay time / launches. So the
figures are device time inside a graph, launch gaps included, as in the captured decode step, but with the
layer alone (the step's other kernels do not compete). Bandwidth = bytes of expert codes + E8M0 scales that
the launch's active experts hold (each read once; activations and outputs left out: < 1% at these shapes) /
that time, and % of this GPU's copy bandwidth measured in the same run.

The sweep stops at its budget (default 210 s): shapes not reached keep no entry (the defaults). On a CPU
(tests only) it runs under TRITON_INTERPRET=1 at a tiny shape with a tiny candidate list and wall-clock
timing: a check of the code path, no figure about any GPU.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from kernels import tuning
from kernels.moe_decode_triton import DECODE_MAX_TOKENS, _down_kernel, _gate_up_kernel, decode_tiles
from kernels.moe_decode_variants import KernelTiles, VariantConfig, VariantLaunches, expert_bytes
from kernels.mxfp8 import MXFP8Tensor

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
REPEAT = 2  # rounds over the weight copies in one graph
NOISE = 0.03  # a variant must beat today's path by more than this fraction to be written


@dataclass(frozen=True)
class Shape:
    """What to sweep: the MoE layer's dimensions, token counts (in the order they are swept), the FP8 dense
    layers as (name, N, K) with their row counts, and how many copies of the weights a graph cycles through."""

    D: int
    I: int  # noqa: E741 - the MoE intermediate size, as everywhere in kernels/
    E: int
    K: int
    tokens: tuple[int, ...]
    fp8_layers: tuple[tuple[str, int, int], ...]
    fp8_rows: tuple[int, ...]
    copies: int
    report_tokens: tuple[int, ...]


GPU_SHAPE = Shape(D=2048, I=768, E=128, K=8, tokens=(1, 8, 32, 16, 64),
                  fp8_layers=(("qkv", 5120, 2048), ("o", 2048, 4096), ("lm_head", 151936, 2048)),
                  fp8_rows=(1, 8, 32, 64), copies=8, report_tokens=(1, 8, 32))
CPU_SHAPE = Shape(D=64, I=32, E=8, K=2, tokens=(1, 3), fp8_layers=(("tiny", 64, 256),), fp8_rows=(1, 4), copies=1,
                  report_tokens=(1, 3))


@dataclass(frozen=True)
class Candidates:
    """gate_up: (variant, tiles) tried at each split of `splits(T)`; down: tiles per variant; fused: (gate_up,
    down) tiles of the fused kernel per variant (VariantConfig's fused fields), up to fused_max_tokens."""

    gate_up: dict[str, tuple[KernelTiles, ...]]
    down: dict[str, tuple[KernelTiles, ...]]
    splits: Callable[[int], tuple[int, ...]]
    fma_max_tokens: int  # the broadcast multiply holds [T, N, K] in registers: only for a few tokens
    fp8: tuple[tuple[int, int, int, int, int], ...]  # (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)
    fused: dict[str, tuple[tuple[KernelTiles, KernelTiles], ...]] = field(default_factory=dict)
    fused_max_tokens: int = 0


KT = KernelTiles
TODAY = VariantConfig("dot", KT(*decode_tiles(False)[0]), KT(*decode_tiles(False)[1]), 1)  # decode_tiles' GPU guess


def _gpu_splits(T: int) -> tuple[int, ...]:
    # at 1 token 8 experts x 768/BLOCK_N programs leave most SMs idle: split D; at 32+ tokens ~110 experts do not.
    # Not 8: down then pipelines 16 partial loads a step, past sm_90's shared memory at every down tile here
    # (compiled for sm_90 on 2026-11-27: 279-541 KB); at 4 only down's 256-wide K tile is too big (skipped)
    return (1, 2, 4) if T <= 8 else (1, 2) if T <= 16 else (1,)


# per-stage shared memory stays under 228 KiB for these at 3 stages (down with split-K partials: fewer; a
# candidate that does not fit is reported and skipped). Today's tiles first.
GPU_CANDIDATES = Candidates(
    gate_up={"dot": (TODAY.gate_up, KT(32, 128, 4, 4), KT(32, 256, 4, 3), KT(64, 128, 4, 3)),
             "swap": (KT(64, 128, 4, 3), KT(64, 256, 4, 3)),
             "fma": (KT(16, 256, 4, 3), KT(32, 128, 4, 3))},
    down={"dot": (TODAY.down, KT(32, 128, 4, 3), KT(64, 128, 4, 3)),
          "swap": (KT(64, 128, 4, 3), KT(128, 64, 4, 3)),
          "fma": (KT(16, 256, 4, 3), KT(32, 128, 4, 3))},
    splits=_gpu_splits, fma_max_tokens=4,
    fp8=((64, 128, 1, 4, 4), (32, 128, 1, 4, 4), (128, 128, 1, 4, 3), (64, 128, 2, 4, 4), (64, 128, 4, 4, 4),
         (32, 128, 4, 4, 4), (64, 128, 8, 4, 4)),
    # the fused kernel: (slice of I x D tile of gate/up rows, warps, stages), (w2's D tile, the sum's D tile).
    # A 32-wide slice: 8 experts x 24 slices = 192 programs at 1 token. Up to 32 tokens: its float32 partials
    # ([I / slice, T*K, D], written once and read once) are ~8% of the expert bytes at 1-16 tokens but a third
    # at 64 (512 pairs x 24 slices x 8 KiB), where the two-launch kernels keep h in bf16.
    fused={"dot": ((KT(32, 256, 4, 3), KT(64, 256, 4, 1)), (KT(64, 128, 4, 3), KT(64, 256, 4, 1)),
                   (KT(32, 128, 4, 4), KT(128, 512, 4, 1))),
           "swap": ((KT(64, 128, 4, 3), KT(128, 256, 4, 1)),),
           "fma": ((KT(32, 256, 4, 3), KT(32, 256, 4, 1)),)},
    fused_max_tokens=32)
CPU_CANDIDATES = Candidates(gate_up={"dot": (KT(16, 32),), "fma": (KT(16, 64),)},
                            down={"dot": (KT(32, 32),), "fma": (KT(16, 32),)},
                            splits=lambda T: (1, 2) if T == 1 else (1,), fma_max_tokens=4,
                            fp8=((32, 32, 1, 1, 1), (32, 32, 2, 1, 1)),
                            fused={"dot": ((KT(32, 64), KT(32, 64)),)}, fused_max_tokens=4)


# -- timing ----------------------------------------------------------------------------------------------


def seconds_per_launch(fns: list[Callable[[], None]], repeat: int = REPEAT) -> float:
    """Device seconds per call of `fns` (each launching one kernel or layer), from a CUDA graph of `repeat`
    rounds over them; on a CPU the wall time of one round (the interpreter: no figure worth the name)."""
    if not CUDA:  # the interpreter compiles nothing: one pass
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) / len(fns)
    for f in fns:  # compile, autotune, allocate outside the capture
        f()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for f in fns:
                f()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / (repeat * len(fns))


def copy_bandwidth(nbytes: int) -> float:
    """Bytes read + written per second by a tensor copy (the practical ceiling), in a graph as the rest."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda" if CUDA else "cpu").uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_launch([lambda: dst.copy_(src)], repeat=4)


@contextlib.contextmanager
def no_table() -> Iterator[None]:
    """Today's defaults while sweeping: no table (an earlier run's) steers the kernels being compared."""
    before = os.environ.get(tuning.DEVICE_ENV)
    os.environ[tuning.DEVICE_ENV] = "composer-tuning-sweep-no-table"
    tuning.reload()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(tuning.DEVICE_ENV, None)
        else:
            os.environ[tuning.DEVICE_ENV] = before
        tuning.reload()


# -- the MoE layer ----------------------------------------------------------------------------------------


@dataclass
class Layers:
    """`copies` layers of random MXFP8 experts and one batch's routing (the same for every copy)."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    w13: list[MXFP8Tensor]
    w2: list[MXFP8Tensor]
    bytes_gate_up: int = 0
    bytes_down: int = 0

    @staticmethod
    def make(shape: Shape, T: int, experts: tuple[list, list], seed: int) -> Layers:
        dev = experts[0][0].data.device
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(T, shape.E, generator=g)
        w, ids = torch.topk(logits.softmax(-1), shape.K)
        x = torch.randn(T, shape.D, generator=g).to(dev, torch.bfloat16 if CUDA else torch.float32)
        lay = Layers(x, ids.to(dev), (w / w.sum(-1, keepdim=True)).to(dev, x.dtype), *experts)
        lay.bytes_gate_up, lay.bytes_down = expert_bytes(lay.ids, shape.D, shape.I)
        return lay


def random_experts(shape: Shape, copies: int) -> tuple[list[MXFP8Tensor], list[MXFP8Tensor]]:
    """MXFP8 expert weights: on a GPU random codes and scales near 1 drawn on the device (a 30B layer in
    ~10 ms); on a CPU quantized from Gaussian weights (so that results can be checked against the reference)."""
    w13s, w2s = [], []
    for c in range(copies):
        if CUDA:
            def mx(*dims):
                data = (torch.randn(*dims, device="cuda") * 0.5).to(torch.float8_e4m3fn)
                scales = torch.randint(118, 123, (*dims[:-1], dims[-1] // 32), device="cuda", dtype=torch.uint8)
                return MXFP8Tensor(data, scales.view(torch.float8_e8m0fnu))
            w13s.append(mx(shape.E, 2 * shape.I, shape.D))
            w2s.append(mx(shape.E, shape.D, shape.I))
        else:
            g = torch.Generator().manual_seed(100 + c)
            w13s.append(MXFP8Tensor.quantize(torch.randn(shape.E, 2 * shape.I, shape.D, generator=g) / shape.D**0.5,
                                             backend="torch"))
            w2s.append(MXFP8Tensor.quantize(torch.randn(shape.E, shape.D, shape.I, generator=g) / shape.I**0.5,
                                            backend="torch"))
    return w13s, w2s


def variant_runs(lay: Layers, config: VariantConfig) -> list[VariantLaunches]:
    return [VariantLaunches(lay.x, lay.ids, lay.weights, w13, w2, config) for w13, w2 in zip(lay.w13, lay.w2, strict=True)]


class TodayLaunches:
    """kernels/moe_decode_triton.py's own two kernels with decode_tiles' guesses, launched apart (as its wrapper
    launches them) so that each can be timed alone: today's figures, per kernel, at any token count."""

    def __init__(self, lay: Layers, w13: MXFP8Tensor, w2: MXFP8Tensor):
        from kernels.backend import interpreting

        T, D = lay.x.shape
        K, inter = lay.ids.shape[1], w2.shape[2]
        interp = interpreting()
        self.args = (lay, w13.data, w13.scales.view(torch.uint8), w2.data, w2.scales.view(torch.uint8))
        self.h = torch.empty((T * K, inter), dtype=torch.float32 if interp else lay.x.dtype, device=lay.x.device)
        self.out = torch.empty((T * K, D), dtype=torch.float32, device=lay.x.device)
        (gn, gk, gw, gs), (dn, dk, dw, ds) = decode_tiles(interp)
        self.gu = (gn, min(gk, triton.next_power_of_2(D)), gw, gs)
        self.dn = (dn, min(dk, triton.next_power_of_2(inter)), dw, ds)
        self.T, self.K, self.D, self.inter, self.interp = T, K, D, inter, interp
        self.block_t, self.block_kk = max(16, triton.next_power_of_2(T)), triton.next_power_of_2(K)

    def gate_up(self) -> None:
        lay, wd, ws, _, _ = self.args
        n, k, w, s = self.gu
        _gate_up_kernel[(self.T * self.K, triton.cdiv(self.inter, n))](
            lay.x, lay.ids, wd, ws, self.h, self.T, self.D, self.inter, lay.x.stride(0), lay.ids.stride(0),
            wd.stride(0), wd.stride(1), ws.stride(0), ws.stride(1), self.h.stride(0),
            TOP_K=self.K, BLOCK_T=self.block_t, BLOCK_KK=self.block_kk, BLOCK_N=n, BLOCK_K=k, F32_DOT=self.interp,
            num_warps=w, num_stages=s)

    def down(self) -> None:
        lay, _, _, wd, ws = self.args
        n, k, w, s = self.dn
        _down_kernel[(self.T * self.K, triton.cdiv(self.D, n))](
            self.h, lay.ids, lay.weights, wd, ws, self.out, self.T, self.D, self.inter, self.h.stride(0),
            lay.ids.stride(0), lay.weights.stride(0), wd.stride(0), wd.stride(1), ws.stride(0), ws.stride(1),
            self.out.stride(0), TOP_K=self.K, BLOCK_T=self.block_t, BLOCK_KK=self.block_kk, BLOCK_N=n, BLOCK_K=k,
            F32_DOT=self.interp, num_warps=w, num_stages=s)


def today_layer(lay: Layers, c: int) -> torch.Tensor:
    """Today's path for this token count (the decode kernels up to DECODE_MAX_TOKENS, the grouped ones above)."""
    from kernels.moe_triton import fused_moe_mxfp8

    return fused_moe_mxfp8(lay.x, lay.ids, lay.weights, lay.w13[c], lay.w2[c], mma="dequant", reduce=False)


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


@dataclass
class Sweep:
    """Results of one run: rows for the report, entries for the table, and what was skipped or failed."""

    rows: list[dict] = field(default_factory=list)
    entries: dict[str, dict[str, dict]] = field(default_factory=lambda: {"moe_decode": {}, "fp8_linear": {}})
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    timed: int = 0


def _try(sweep: Sweep, what: str, fn: Callable[[], float]) -> float | None:
    """One timing; a candidate that does not compile or launch (shared memory, registers) is noted and skipped."""
    try:
        t = fn()
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run is a result, not the end of the sweep
        sweep.failed.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        return None
    sweep.timed += 1
    return t


def sweep_moe(shape: Shape, cands: Candidates, T: int, experts, deadline: float, sweep: Sweep, log) -> None:
    lay = Layers.make(shape, T, experts, seed=T)
    grouped = T > DECODE_MAX_TOKENS
    key = tuning.shape_key("moe_decode", "bf16" if CUDA else "fp32", T=T, D=shape.D, I=shape.I, E=shape.E, K=shape.K)
    copies = range(len(lay.w13))
    ref = today_layer(lay, 0)
    t_today = _try(sweep, f"T={T} today", lambda: seconds_per_launch([lambda c=c: today_layer(lay, c) for c in copies]))
    if t_today is None:
        return
    # gate_up: per (variant, split), its best tiles; it gets 60% of this token count's time (compiling dominates)
    gu_deadline = time.perf_counter() + 0.6 * (deadline - time.perf_counter())
    best_gu: dict[tuple[str, int], tuple[float, KernelTiles]] = {}
    # every (variant, split)'s first tiles before anyone's second: a budget cut leaves each one a candidate
    order = sorted(((rank, variant, split, tiles) for variant, tiles_list in cands.gate_up.items()
                    if variant != "fma" or T <= cands.fma_max_tokens
                    for split in cands.splits(T) for rank, tiles in enumerate(tiles_list)), key=lambda c: c[0])
    for _, variant, split, tiles in order:
        if time.perf_counter() > gu_deadline:
            sweep.skipped.append(f"moe T={T}: gate_up {variant} split {split} {tiles} (budget)")
            continue
        cfg = VariantConfig(variant, tiles, TODAY.down, split)
        t = _try(sweep, f"T={T} gate_up {cfg.label()}",
                 lambda cfg=cfg: seconds_per_launch([r.gate_up for r in variant_runs(lay, cfg)]))
        if t is not None and ((variant, split) not in best_gu or t < best_gu[(variant, split)][0]):
            best_gu[(variant, split)] = (t, tiles)
    # the fused kernel, whole layers (its one launch + the sum of its partials): its own share of the time left
    pairs: list[tuple[float, VariantConfig]] = []
    fused_deadline = time.perf_counter() + 0.4 * (deadline - time.perf_counter())
    for variant, tiles_list in cands.fused.items() if T <= cands.fused_max_tokens else ():
        if variant == "fma" and T > cands.fma_max_tokens:
            continue
        for gu_tiles, dn_tiles in tiles_list:
            cfg = VariantConfig(variant, gu_tiles, dn_tiles, 1, fused=True)
            if time.perf_counter() > fused_deadline:
                sweep.skipped.append(f"moe T={T}: {cfg.label()} (budget)")
                continue
            t = _try(sweep, f"T={T} layer {cfg.label()}", lambda cfg=cfg: seconds_per_launch(
                [lambda r=r: (r.gate_up(), r.down()) for r in variant_runs(lay, cfg)]))
            if t is not None:
                pairs.append((t, cfg))
    # down: for each variant, after its best gate_up without a split and its best with one
    for variant in sorted({v for v, _ in best_gu}, key=lambda v: min(t for (w, _), (t, _) in best_gu.items() if w == v)):
        by_time = sorted((t, s) for (v, s), (t, _) in best_gu.items() if v == variant)
        picks = [s for _, s in by_time if s == 1] + [s for _, s in by_time if s > 1][:1]  # unsplit, best split
        for split in picks:
            t_gu, gu_tiles = best_gu[(variant, split)]
            best_dn = None
            for tiles in cands.down[variant]:
                if time.perf_counter() > deadline:
                    sweep.skipped.append(f"moe T={T}: down {variant} split {split} {tiles} (budget)")
                    continue
                cfg = VariantConfig(variant, gu_tiles, tiles, split)

                def down_only(cfg=cfg) -> float:
                    runs = variant_runs(lay, cfg)
                    for r in runs:  # h (or the partials) filled once; down alone is timed
                        r.gate_up()
                    return seconds_per_launch([r.down for r in runs])

                t = _try(sweep, f"T={T} down {cfg.label()}", down_only)
                if t is not None and (best_dn is None or t < best_dn[0]):
                    best_dn = (t, cfg)
            if best_dn is not None:
                pairs.append((t_gu + best_dn[0], best_dn[1]))
    pairs.sort(key=lambda p: p[0])
    entry: dict = {"variant": "default", "default_path": "grouped" if grouped else "decode", "default_us": t_today * 1e6}
    row = {"kind": "moe_layer", "tokens": T, "default_path": entry["default_path"], "default_us": t_today * 1e6,
           "expert_bytes": lay.bytes_gate_up + lay.bytes_down}
    if pairs:
        cfg = pairs[0][1]
        runs = variant_runs(lay, cfg)
        t_best = _try(sweep, f"T={T} layer {cfg.label()}",
                      lambda: seconds_per_launch([lambda r=r: (r.gate_up(), r.down()) for r in runs]))
        out = runs[0].rows()
        gap = relative_gap(out, ref)
        row |= {"best": cfg.label(), "best_us": None if t_best is None else t_best * 1e6, "max_rel_gap": gap}
        tol = 2e-2 if CUDA else 1e-4  # bf16 operands against float32 sums in another order
        if gap > tol:
            sweep.failed.append(f"T={T} {cfg.label()}: output differs from today's path by {gap:.2e} (> {tol}): not written")
        elif t_best is not None and t_best < t_today * (1 - NOISE):
            entry = cfg.to_json() | {"us": t_best * 1e6, "default_us": t_today * 1e6,
                                     "default_path": entry["default_path"],
                                     "gb_s": row["expert_bytes"] / t_best / 1e9}
    row["chosen"] = entry["variant"] if entry["variant"] == "default" else row["best"]
    row["speedup"] = t_today * 1e6 / entry.get("us", t_today * 1e6)
    sweep.entries["moe_decode"][key] = entry
    sweep.rows.append(row)
    log(f"tune moe T={T}: today ({row['default_path']}) {t_today * 1e6:.1f} us; best {row.get('best')} "
        f"{row.get('best_us') or float('nan'):.1f} us -> {row['chosen']}")


def kernel_bandwidth(shape: Shape, T: int, experts, copy_bw: float, sweep: Sweep, entry: dict | None) -> None:
    """Each MoE kernel alone in a graph at T tokens: today's decode kernels, and the table's `entry` if it
    names a variant."""
    lay = Layers.make(shape, T, experts, seed=1000 + T)
    which: list[tuple[str, list]] = [("today's decode kernels", [TodayLaunches(lay, w13, w2)
                                                                for w13, w2 in zip(lay.w13, lay.w2, strict=True)])]
    if entry and entry["variant"] not in ("default", "grouped"):
        cfg = VariantConfig.from_json(entry)
        which.append((f"tuned: {cfg.label()}", variant_runs(lay, cfg)))
    for label, runs in which:
        for r in runs:
            r.gate_up()
        kernels = (("gate_up", lay.bytes_gate_up), ("down", lay.bytes_down))
        if getattr(runs[0], "config", None) is not None and runs[0].config.fused:
            # the fused kernel reads all the experts' bytes; the sum reads its float32 partials (no expert bytes)
            kernels = (("fused gate_up+down", lay.bytes_gate_up + lay.bytes_down), ("sum of partials", 0))
        for (kernel, expert), fns in zip(kernels, ([r.gate_up for r in runs], [r.down for r in runs]), strict=True):
            t = _try(sweep, f"bandwidth T={T} {label} {kernel}", lambda fns=fns: seconds_per_launch(fns))
            if t is None:
                continue
            nbytes = expert or runs[0].h.numel() * 4
            sweep.rows.append({"kind": "moe_kernel", "tokens": T, "kernel": kernel, "which": label, "us": t * 1e6,
                               "expert_mb": expert / 1e6, "gb_s": nbytes / t / 1e9,
                               "pct_copy": 100 * nbytes / t / copy_bw})


def bandwidth_report(shape: Shape | None = None, device_name: str | None = None, folder: Path | None = None,
                     copy_bw: float | None = None, log=print) -> dict:
    """bench/gpu.py's MoE kernel bandwidth at the report's token counts (1, 8, 32), today's kernels and what
    the device's table picks (read back through kernels/tuning.py, as the kernels read it)."""
    shape = shape or (GPU_SHAPE if CUDA else CPU_SHAPE)
    sweep = Sweep()
    with torch.inference_mode():
        copy_bw = copy_bw or copy_bandwidth(1 << 30 if CUDA else 1 << 22)
        experts = random_experts(shape, shape.copies)
        dtype = "bf16" if CUDA else "fp32"
        for T in shape.report_tokens:
            entry = tuning.lookup("moe_decode", dtype, device_name=device_name, folder=folder, T=T, D=shape.D,
                                  I=shape.I, E=shape.E, K=shape.K)
            try:
                kernel_bandwidth(shape, T, experts, copy_bw, sweep, entry)
            except Exception as e:  # noqa: BLE001 - each kernel's timing is already guarded; this is the set-up
                sweep.failed.append(f"bandwidth T={T}: {type(e).__name__}: {str(e)[:300]}")
        for r in sweep.rows:
            log(f"bandwidth T={r['tokens']} {r['kernel']} ({r['which']}): {r['us']:.1f} us, {r['gb_s']:.0f} GB/s = "
                f"{r['pct_copy']:.1f}% of copy")
    return {"rows": sweep.rows, "failed": sweep.failed, "copy_gb_s": copy_bw / 1e9}


# -- the FP8 dense kernel ---------------------------------------------------------------------------------


def sweep_fp8(shape: Shape, cands: Candidates, deadline: float, sweep: Sweep, log) -> None:
    from kernels.fp8_block import quantize_block_fp8
    from kernels.fp8_linear_triton import fp8_linear_triton, tiles

    dev = torch.device("cuda" if CUDA else "cpu")
    dtype = torch.bfloat16 if CUDA else torch.float32
    for name, N, Kd in shape.fp8_layers:
        # enough copies that one launch's weights are out of L2 when it comes round again
        copies = max(1, min(shape.copies, -(-200_000_000 // (N * Kd)))) if CUDA else shape.copies
        ws = [quantize_block_fp8((torch.randn(N, Kd, device=dev) * 0.02).to(dtype)) for _ in range(copies)]
        nbytes = N * Kd + ws[0][1].numel() * 4
        for M in shape.fp8_rows:
            if time.perf_counter() > deadline:
                sweep.skipped.append(f"fp8 {name} M={M}: budget")
                continue
            x = torch.randn(M, Kd, device=dev).to(dtype)
            today = tiles(M, N, Kd, dev, not CUDA, dtype)
            bm = today[0]
            results = []
            for cand in [today, *[(bm, *c) for c in cands.fp8 if (bm, *c) != today]]:
                if time.perf_counter() > deadline:
                    sweep.skipped.append(f"fp8 {name} M={M}: the rest of the candidates (budget)")
                    break
                t = _try(sweep, f"fp8 {name} M={M} {cand}", lambda cand=cand, x=x, ws=ws: seconds_per_launch(
                    [lambda d=d, s=s: fp8_linear_triton(x, d, s, config=cand) for d, s in ws]))
                if t is not None:
                    results.append((t, cand))
            if not results or results[0][1] != today:
                continue  # today's own config did not run: nothing to compare against
            t_today = results[0][0]
            t_best, best = min(results)
            ref = fp8_linear_triton(x, *ws[0], config=today)
            gap = relative_gap(fp8_linear_triton(x, *ws[0], config=best), ref)
            win = t_best < t_today * (1 - NOISE) and gap < (2e-2 if CUDA else 1e-4)
            key = tuning.shape_key("fp8_linear", tuning.DTYPES[dtype], M=M, N=N, K=Kd)
            chosen = best if win else today
            sweep.entries["fp8_linear"][key] = dict(zip(("block_m", "block_n", "block_k", "split_k", "num_warps",
                                                         "num_stages"), chosen, strict=True)) | {
                "us": (t_best if win else t_today) * 1e6, "default_us": t_today * 1e6}
            sweep.rows.append({"kind": "fp8", "layer": name, "M": M, "default_us": t_today * 1e6,
                               "best_us": t_best * 1e6, "best": str(best), "chosen": str(chosen),
                               "gb_s": nbytes / (t_best if win else t_today) / 1e9, "max_rel_gap": gap})
            log(f"tune fp8 {name} M={M}: today {today} {t_today * 1e6:.1f} us; best {best} {t_best * 1e6:.1f} us")


# -- the run ------------------------------------------------------------------------------------------------


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(budget_s: float = 210.0, shape: Shape | None = None, cands: Candidates | None = None,
        folder: Path | None = None, device_name: str | None = None, log=print) -> dict:
    """Sweep, write the table (GPU: kernels/tuned/; else `folder`, required), report. Returns
    {"rows", "table" (its path), "skipped", "failed", "seconds", "copy_gb_s"}."""
    shape = shape or (GPU_SHAPE if CUDA else CPU_SHAPE)
    cands = cands or (GPU_CANDIDATES if CUDA else CPU_CANDIDATES)
    if not CUDA and folder is None:
        raise ValueError("on a CPU the sweep writes its table only where asked (folder=...): kernels/tuned/ holds GPUs'")
    from kernels.backend import interpreting
    if not CUDA and not interpreting():
        raise RuntimeError("the sweep runs the Triton kernels: on a CPU only under TRITON_INTERPRET=1")
    device_name = device_name or (torch.cuda.get_device_name() if CUDA else "cpu-interpreter")
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    sweep = Sweep()
    with no_table(), torch.inference_mode():
        copy_bw = copy_bandwidth(1 << 30 if CUDA else 1 << 22)
        log(f"tune: copy bandwidth {copy_bw / 1e9:.0f} GB/s")
        experts = random_experts(shape, shape.copies)
        # the MoE layer gets ~3/4 of the budget, shared among its token counts; the FP8 kernel the rest
        moe_end = t0 + 0.75 * budget_s
        for i, T in enumerate(shape.tokens):
            now = time.perf_counter()
            if now > moe_end:
                sweep.skipped.append(f"moe T={T}: budget")
                continue
            try:  # one token count failing (out of memory, a compiler error) leaves the others their entries
                sweep_moe(shape, cands, T, experts, now + (moe_end - now) / (len(shape.tokens) - i), sweep, log)
            except Exception as e:  # noqa: BLE001 - reported in the section, the sweep goes on
                sweep.failed.append(f"moe T={T}: {type(e).__name__}: {str(e)[:300]}")
                log(f"tune moe T={T} FAILED: {type(e).__name__}: {e}")
        experts = None
        if CUDA:
            torch.cuda.empty_cache()
        try:
            sweep_fp8(shape, cands, deadline, sweep, log)
        except Exception as e:  # noqa: BLE001
            sweep.failed.append(f"fp8: {type(e).__name__}: {str(e)[:300]}")
            log(f"tune fp8 FAILED: {type(e).__name__}: {e}")
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": _commit(), "torch": torch.__version__,
            "triton": triton.__version__, "sweep_s": round(time.perf_counter() - t0, 1), "candidates_timed": sweep.timed,
            "copy_gb_s": round(copy_bw / 1e9, 1), "timing": "CUDA graph, median of 5 replays" if CUDA else
            "wall clock under the Triton interpreter (a code-path check, not a measurement)",
            "shape": {"D": shape.D, "I": shape.I, "E": shape.E, "K": shape.K}}
    if CUDA:
        major, minor = torch.cuda.get_device_capability()
        meta["capability"] = f"sm_{major}{minor}"
        meta["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    entries = {k: v for k, v in sweep.entries.items() if v}
    path = tuning.write_table(tuning.Table(device_name, entries, meta), folder)
    log(f"tune: {sweep.timed} timings in {meta['sweep_s']} s; wrote {path}")
    # the kernels' bandwidth with the table just written, read back as the kernels read it
    bw = bandwidth_report(shape, device_name, folder, copy_bw, log)
    return {"rows": sweep.rows + bw["rows"], "table": str(path), "skipped": sweep.skipped,
            "failed": sweep.failed + bw["failed"], "seconds": meta["sweep_s"], "copy_gb_s": copy_bw / 1e9}


def plot(rows: list[dict], png: Path, title: str) -> Path | None:
    """Each MoE kernel's % of copy bandwidth by token count (today's and tuned), and the layer's time today
    against the tuned choice; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    kernels = [r for r in rows if r["kind"] == "moe_kernel"]
    layers = [r for r in rows if r["kind"] == "moe_layer"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(r["kernel"], r["which"].split(":")[0]) for r in kernels})
    tokens = sorted({r["tokens"] for r in kernels})
    width = 0.8 / max(1, len(series))
    for i, (kernel, which) in enumerate(series):
        got = {r["tokens"]: r["pct_copy"] for r in kernels if r["kernel"] == kernel and r["which"].startswith(which)}
        a.bar([j + i * width for j in range(len(tokens))], [got.get(t, 0.0) for t in tokens], width,
              label=f"{kernel}, {which}")
    a.axhline(60, color="grey", linestyle="--", linewidth=1)  # the goal
    a.set_xticks([j + 0.4 - width / 2 for j in range(len(tokens))], [str(t) for t in tokens])
    a.set_xlabel("tokens")
    a.set_ylabel("% of copy bandwidth")
    a.set_title("MoE kernels alone in a CUDA graph (goal: 60%)")
    a.legend(fontsize=7)
    layers.sort(key=lambda r: r["tokens"])
    xs = range(len(layers))
    b.bar([x - 0.2 for x in xs], [r["default_us"] for r in layers], 0.4, label="today's path")
    b.bar([x + 0.2 for x in xs], [r["default_us"] / r["speedup"] for r in layers], 0.4, label="written to the table")
    b.set_xticks(list(xs), [f"{r['tokens']}" for r in layers])
    b.set_xlabel("tokens")
    b.set_ylabel("us per layer")
    b.set_title("MoE layer: today vs tuned")
    b.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png

