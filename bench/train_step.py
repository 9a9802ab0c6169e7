"""One trainer step at the Qwen3-30B-A3B layer shape, measured: seconds, tokens/s, MFU, peak memory, and
the split into forward, backward, optimizer and quantisation, beside the memory plan's figure.

    python bench/train_step.py                      # GPU: 4 layers of Qwen3-30B-A3B, 8 x 2,048 tokens
    python bench/train_step.py --shape reduced      # CPU: a reduced shape (2 layers, hidden 256, 64 experts top-8)
    python bench/train_step.py --activation-checkpointing --steps 3 --json out.json
    python bench/train_step.py --option default --option fused-expert-backward --profile   # side by side

Random weights made on the device (TrainerConfig.load_format="dummy"), float32 masters with AdamW, the
compute dtype composer-serve would use (bf16 on a GPU, float32 on a CPU), MXFP8 experts (straight
through), half of each sequence trained (the other half prompt), micro-batches of --micro-batch-tokens.
The first step is reported apart (allocation, autotuning); the figures are the median of the others.

MFU = useful FLOPs / step time / the measured bf16 matmul rate (an 8192^3 matmul timed here, not the
datasheet): 6 x (active parameters of the layers x every token + LM head x trained tokens) plus causal
attention (6 x 2 x L/2 x heads x head_dim per token per layer). bench/gpu.py runs this as its "train" section.

`--option NAME` (repeatable; OPTIONS) measures trainer options one after the other in this process, each on a
fresh trainer, each result naming its option and TrainerConfig fields; `--profile` adds one more step under
torch.profiler and records the 30 ops with the most device (CPU: host) time, so the next run says where the
step goes rather than leaving it to be inferred.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serve.model.config import QWEN3_30B_A3B  # noqa: E402

REDUCED = dict(QWEN3_30B_A3B, vocab_size=32768, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
               head_dim=32, moe_intermediate_size=128, num_experts=64, num_experts_per_tok=8)


OPTIONS: dict[str, dict] = {
    "default": {},
    # kernels/moe_grouped.py moe_backward_fused: 5 grouped GEMMs instead of 6, the SwiGLU backward in one kernel
    "fused-expert-backward": {"expert_backward": "fused"},
    # kernels/rms_norm_triton.py: each RMSNorm's forward and backward one launch
    "fused-norms": {"fused_norms": True},
    # kernels/lm_head_triton.py: each vocabulary slice's softmax work one launch each way
    "fused-lm-head": {"fused_lm_head": True},
    "fused-all": {"expert_backward": "fused", "fused_norms": True, "fused_lm_head": True},
    # the step's 16k tokens in one micro-batch instead of four: the per-micro-batch costs that scale with the
    # weights (expert dequantization and layout copies, bf16 -> fp32 gradient casts and accumulation, the masters'
    # bf16 copies) once per step, and 512 instead of 128 rows per expert GEMM; the same arithmetic otherwise
    "micro-batch-16k": {"micro_batch_tokens": 16384},
    "fused-all-16k": {"expert_backward": "fused", "fused_norms": True, "fused_lm_head": True,
                      "micro_batch_tokens": 16384},
}


def useful_flops(cfg: dict, seqs: int, length: int, trained: int) -> float:
    D, H, G, C = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    active = D * H * C * 2 + 2 * D * G * C + cfg["num_experts"] * D \
        + cfg["num_experts_per_tok"] * 3 * D * cfg["moe_intermediate_size"]
    tokens = seqs * length
    layers = cfg["num_hidden_layers"]
    attention = 6 * 2 * (length / 2) * H * C  # per token per layer: QK^T and PV, forward + backward
    return 6 * active * tokens * layers + attention * tokens * layers + 6 * cfg["vocab_size"] * D * trained


def matmul_rate(device: str) -> float:
    """Measured bf16 (GPU) / float32 (CPU) matmul FLOP/s."""
    import torch

    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 20 if device == "cuda" else 5
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


class Peak:
    """Peak memory during a block: the CUDA allocator's, or on a CPU the process's high-water mark of
    resident memory (reset through /proc/self/clear_refs) above what it held when the block began."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.peak = status_kib("VmHWM") * 1024
        self.increase = self.peak - self.base


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def make_samples(vocab: int, seqs: int, length: int):
    import torch

    from train.samples import Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(seqs):
        ids = torch.randint(10, vocab - 10, (length,), generator=g).tolist()
        s = Sample(episode=f"e{i}", segment=0, versions=[0], requests=1)
        s.extend(ids[: length // 2], sampled=False)
        s.extend(ids[length // 2:], sampled=True, logprobs=[-3.0] * (length - length // 2))
        out.append(s)
    return out


def measure(shape: str = "qwen3-30b-a3b", layers: int = 4, seqs: int = 8, length: int = 2048,
            micro_batch_tokens: int = 4096, steps: int = 3, activation_checkpointing: bool = False,
            vocab_chunk: int = 16384, log=print, option: str = "default", profile: bool = False) -> dict:
    import torch

    from serve.model.config import ModelConfig
    try:
        from train.memory_plan import memory_plan
    except ImportError:  # an older trainer
        memory_plan = None
    from train.trainer import Trainer, TrainerConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = dict(QWEN3_30B_A3B if shape == "qwen3-30b-a3b" else REDUCED, num_hidden_layers=layers)
    folder = Path(tempfile.mkdtemp(prefix="bench-train-step-"))
    (folder / "config.json").write_text(json.dumps(cfg))
    kw = dict(load_format="dummy", activation_checkpointing=activation_checkpointing, vocab_chunk=vocab_chunk)
    known = TrainerConfig.__dataclass_fields__
    if "load_format" not in known:  # an older trainer (before/after figures): random weights the old way
        import train.trainer as trainer_module
        from serve.model.dummy import random_model

        trainer_module.load_model = random_model
    if option not in OPTIONS:
        raise ValueError(f"unknown option {option!r}: one of {', '.join(OPTIONS)}")
    missing = [k for k in OPTIONS[option] if k not in known]
    if missing:
        raise ValueError(f"option {option!r} needs TrainerConfig fields this trainer lacks: {missing}")
    micro_batch_tokens = OPTIONS[option].get("micro_batch_tokens", micro_batch_tokens)
    tc = TrainerConfig(**{"mxfp8_experts": True, "lr": 1e-5, "micro_batch_tokens": micro_batch_tokens,
                          **{k: v for k, v in kw.items() if k in known}, **OPTIONS[option]})
    t0 = time.perf_counter()
    trainer = Trainer(folder, tc)
    built = time.perf_counter() - t0
    compute = trainer.dtype
    plan = None if memory_plan is None else memory_plan(ModelConfig.from_dir(folder), compute_bytes=compute.itemsize, micro_batch_tokens=micro_batch_tokens,
                       activation_checkpointing=activation_checkpointing, vocab_chunk=vocab_chunk,
                       on_gpu=device == "cuda", scored_tokens=micro_batch_tokens // 2)
    samples = make_samples(cfg["vocab_size"], seqs, length)
    trained = sum(sum(s.mask[1:]) for s in samples)
    adv = [1.0 if i % 2 else -1.0 for i in range(seqs)]
    flops = useful_flops(cfg, seqs, length, trained)
    rate = matmul_rate(device)
    moes = trainer.model.moe_layers()
    # quantisation: all MoE layers' experts once (what the cache does once per step), timed alone
    from kernels import MXFP8Tensor

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    tq = time.perf_counter()
    for moe in moes:
        MXFP8Tensor.quantize(moe.w13.detach()), MXFP8Tensor.quantize(moe.w2.detach())
    sync()
    quant_s = time.perf_counter() - tq
    rows = []
    for i in range(steps):
        trainer.phase_times = {}
        cached = all(getattr(m, "quant_cache", None) is not None for m in moes)
        before = [m.quant_cache.quantizations for m in moes] if cached else []
        with Peak(device) as peak:
            t = time.perf_counter()
            out = trainer.step(samples, adv)
            sync()
            dt = time.perf_counter() - t
        quants = sum(m.quant_cache.quantizations for m in moes) - sum(before) if cached else None
        row = {"step": i, "s": round(dt, 4), "tokens_per_s": round(seqs * length / dt),
               "mfu": round(flops / dt / rate, 4), "peak_bytes": peak.peak, "step_increase_bytes": peak.increase,
               "phases_s": {k: round(v, 4) for k, v in (trainer.phase_times or {}).items()},
               "quantizations": quants, "loss": out["loss"]}
        rows.append(row)
        log(f"step {i}: {dt:.3f} s, step's increase {peak.increase / 2**30:.3f} GiB, {row['tokens_per_s']} tokens/s, MFU {row['mfu']:.1%}, peak "
            f"{peak.peak / 2**30:.2f} GiB, phases {row['phases_s']}, expert quantizations {quants}")
    top_ops = profile_step(trainer, samples, adv, device, log) if profile else None
    steady = rows[1:] or rows
    med = statistics.median(r["s"] for r in steady)
    result = {"option": option, "trainer_options": OPTIONS[option],
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": shape,
              "config": {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok",
                                             "moe_intermediate_size", "vocab_size")},
              "seqs": seqs, "len": length, "trained_tokens": trained, "micro_batch_tokens": micro_batch_tokens,
              "activation_checkpointing": activation_checkpointing, "compute_dtype": str(compute),
              "trainer_built_s": round(built, 2), "useful_flops": flops, "matmul_flops_per_s": rate,
              "first_step_s": rows[0]["s"], "step_s": med, "tokens_per_s": round(seqs * length / med),
              "mfu": round(flops / med / rate, 4), "quantize_all_experts_s": round(quant_s, 4),
              "peak_bytes": max(r["peak_bytes"] for r in rows), "plan_bytes": plan and round(plan.total),
              "plan": plan and plan.as_dict(), "steps": rows, "profile_top_ops": top_ops}
    log(f"[{option}] median step {med:.3f} s, {result['tokens_per_s']} tokens/s, MFU {result['mfu']:.1%} of a measured "
        f"{rate / 1e12:.2f} TFLOP/s; peak {result['peak_bytes'] / 2**30:.2f} GiB, plan "
        f"{plan.total / 2**30 if plan else float('nan'):.2f} GiB; "
        f"quantizing every expert once {quant_s:.3f} s")
    return result


def profile_step(trainer, samples, adv, device: str, log=print, top: int = 30) -> list[dict]:
    """One more step under torch.profiler. First row: the profiled step's wall time and, on a GPU, the kernels'
    time over it (`device_busy`: well under 1 means the GPU waits for the host, launches and syncs, rather
    than kernels being slow) and the launches; then the `top` ops by device time attributed to them (host
    time on a CPU), then on a GPU the `top` kernels by their own time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trainer.phase_times = None
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        trainer.step(samples, adv)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    host = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = [e for e in events if e.device_type != DeviceType.CPU]

    def own(e) -> float:  # microseconds
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    busy_us = sum(e.self_device_time_total for e in kernels)
    head = {"op": "(step)", "wall_ms": round(wall * 1e3, 2), "device_busy": round(busy_us / 1e6 / wall, 3) if cuda else None,
            "launches": sum(e.count for e in kernels)}
    total = sum(own(e) for e in host) or 1.0
    out = [head] + [{"op": e.key, "kind": "op", "calls": e.count, "self_ms": round(own(e) / 1e3, 3),
                     "share": round(own(e) / total, 4)} for e in sorted(host, key=own, reverse=True)[:top]]
    out += [{"op": e.key, "kind": "kernel", "calls": e.count, "self_ms": round(e.self_device_time_total / 1e3, 3),
             "share": round(e.self_device_time_total / (busy_us or 1.0), 4)}
            for e in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]]
    log(f"profile: step {wall * 1e3:.1f} ms" + (f", kernels {busy_us / 1e3:.1f} ms (device busy {head['device_busy']:.0%}), "
                                                  f"{head['launches']} launches" if cuda else "") + "; top ops:")
    for r in out[1:13]:
        log(f"  {r['kind']:6} {r['self_ms']:9.3f} ms {r['share']:6.1%} x{r['calls']:<5} {r['op'][:90]}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("qwen3-30b-a3b", "reduced"), default=None,
                   help="default: qwen3-30b-a3b on a GPU, reduced on a CPU")
    p.add_argument("--layers", type=int, default=None, help="default 4 (GPU) / 2 (CPU)")
    p.add_argument("--seqs", type=int, default=None, help="default 8 (GPU) / 4 (CPU)")
    p.add_argument("--len", type=int, default=None, help="tokens per sequence, default 2048 (GPU) / 512 (CPU)")
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--vocab-chunk", type=int, default=16384, help="LM head slice (a value >= the vocabulary: unsliced)")
    p.add_argument("--option", action="append", choices=list(OPTIONS),
                   help="trainer options to measure one after the other (default: default)")
    p.add_argument("--profile", action="store_true", help="one more step under torch.profiler: its top ops")
    p.add_argument("--json", type=Path, help="write the result here (a list when several options ran)")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        torch.set_num_threads(2)
    results = []
    for option in args.option or ["default"]:
        results.append(measure(args.shape or ("qwen3-30b-a3b" if gpu else "reduced"), args.layers or (4 if gpu else 2),
                               args.seqs or (8 if gpu else 4), args.len or (2048 if gpu else 512),
                               args.micro_batch_tokens, args.steps, args.activation_checkpointing, args.vocab_chunk,
                               option=option, profile=args.profile))
        free_memory()
    if len(results) > 1:
        base = results[0]["step_s"]
        print("option                     step s   MFU    vs first")
        for r in results:
            print(f"{r['option']:26} {r['step_s']:7.3f} {r['mfu']:6.1%} {base / r['step_s']:7.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
