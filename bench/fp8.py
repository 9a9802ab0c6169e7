"""FP8 on a CPU (issue 51, items 3-4): Qwen's block-FP8 checkpoints and `--quant-dense fp8`, logit gaps.

    python bench/fp8.py [--out bench/fp8-results]

A tiny random Qwen3-MoE (bf16 weights, 2 layers, hidden 256, 4 heads of 64, 8 experts of 128: every dense dim a
multiple of 128, as in the real models) is quantized by transformers' own FineGrainedFP8 quantizer op into
Qwen's FP8 layout (serve/model/fp8_format.py); transformers loads that checkpoint the way it does on a CPU
(dequantizing it): the reference. Rows, each over 4 forced sequences (8 prompt tokens + 40 followed):

1. checkpoint: the native engine on the FP8 checkpoint against transformers' load of it (float32; bfloat16;
   experts re-encoded to MXFP8, with the re-encoding's relative RMS error), and what FP8 itself costs:
   transformers on the FP8 checkpoint against transformers on the bf16 original.
2. quant-dense: the native engine with `quant_dense="fp8"` against `"none"` on the bf16 checkpoint (float32
   and bfloat16 engines), beside the gap bfloat16 itself makes (engine bf16 against engine float32), and
   where the gap comes from (transformers float32 with only the LM head, only the attention projections,
   or both rounded to block FP8; and a control: the attention weights perturbed by Gaussian noise of the same
   relative RMS as the rounding, which says whether the gap is FP8's or this model's sensitivity).
Each row: max and mean |d logit|, the mean relative to the logits' spread (std), greedy agreement over the
positions; quant-dense rows also greedy generation from 4 prompts x 24 tokens (tokens equal before the
first divergence). A random model's logits are chaotic in its router (a small change flips an expert
choice), so the gaps here are upper-bound-ish; a trained model's would be measured on a GPU
(bench/gpu.py's fp8 section has the 30B shape, random weights too). JSON and a plot go to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.fp8_block import dequantize_block_fp8, quantize_block_fp8  # noqa: E402
from serve.engine.base import SamplingParams  # noqa: E402
from serve.engine.native import EngineConfig, NativeEngine  # noqa: E402
from serve.engine.parity import forced_logits  # noqa: E402
from serve.model import fp8_format  # noqa: E402
from serve.tiny import TinySpec, build_tiny_checkpoint  # noqa: E402

SPEC = TinySpec(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2)
SPLIT, FOLLOW, SEQS, GEN = 8, 40, 4, 24


def transformers_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize op (what FineGrainedFP8Config runs; from_pretrained refuses it without a GPU)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class _Quantizer:
        quantization_config = FineGrainedFP8Config(weight_block_size=(128, 128))

    out = Fp8Quantize(_Quantizer()).convert({"m.weight": w})
    return out["m.weight"], out["m.weight_scale_inv"]


def sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(3, 1000, (SEQS, SPLIT + FOLLOW), generator=g).tolist()


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """a, b: per sequence logits [P, V]; b against the reference a."""
    A, B = torch.cat(a).float(), torch.cat(b).float()
    d = (B - A).abs()
    return {"positions": A.shape[0], "max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "mean_rel_std": float(d.mean() / A.std()), "greedy_agree": float((A.argmax(-1) == B.argmax(-1)).float().mean())}


def engine_run(model_dir: Path, gen: bool = False, **kw) -> dict:
    engine = NativeEngine(str(model_dir), EngineConfig(max_model_len=256, max_num_seqs=SEQS, **kw))
    try:
        out = {"logits": [forced_logits(engine, s, SPLIT) for s in sequences()], "describe": engine.describe()}
        if gen:
            async def one(p):
                return [t.id async for t in engine.generate(p, SamplingParams(max_tokens=GEN, temperature=0.0))]

            async def main():
                return await asyncio.gather(*(one(s[:SPLIT]) for s in sequences()))

            out["greedy"] = asyncio.run(main())
        out["report"] = getattr(engine.model, "fp8_report", None)
        return out
    finally:
        asyncio.run(engine.stop())


def transformers_logits(model_dir: Path, dtype: torch.dtype = torch.float32, fake_quant: tuple[str, ...] = (),
                        noise: float = 0.0) -> list:
    """transformers' logits along sequences(); the Linear layers named in `fake_quant` rounded to block FP8, or,
    with `noise`, perturbed by Gaussian noise of that RMS relative to their weights' (the control)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, m in model.named_modules():
            if not (isinstance(m, torch.nn.Linear) and any(name.endswith(s) for s in fake_quant)):
                continue
            if noise:
                m.weight += torch.randn(m.weight.shape, generator=g) * m.weight.pow(2).mean().sqrt() * noise
            else:
                m.weight.copy_(dequantize_block_fp8(*quantize_block_fp8(m.weight), m.weight.dtype))
        return [model(torch.tensor([s])).logits[0, SPLIT - 1:].float() for s in sequences()]


def same_prefix(a: list[list[int]], b: list[list[int]]) -> dict:
    prefix = [next((i for i, (x, y) in enumerate(zip(p, q, strict=False)) if x != y), min(len(p), len(q)))
              for p, q in zip(a, b, strict=True)]
    return {"gen_tokens_before_divergence": sum(prefix), "gen_tokens": sum(len(p) for p in a),
            "gen_sequences_same": sum(p == q for p, q in zip(a, b, strict=True))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "fp8-results")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp())
    src = build_tiny_checkpoint(work / "bf16", spec=SPEC, dtype="bfloat16")
    fp8 = work / "fp8"
    n = fp8_format.write_checkpoint(src, fp8, transformers_quantize)
    print(f"tiny checkpoint {SPEC}: {n} weights quantized to block FP8 by transformers' quantizer", flush=True)
    rows = []

    def add(section: str, name: str, g: dict, **extra) -> None:
        rows.append({"section": section, "row": name, **g, **extra})
        print(f"{section:11s} {name:58s} max {g['max_abs']:.2e}  mean {g['mean_abs']:.2e} ({100 * g['mean_rel_std']:.2f}% "
              f"of std)  greedy {g['greedy_agree']:.3f}" + "".join(f"  {k} {v}" for k, v in extra.items()), flush=True)

    ref_fp8 = transformers_logits(fp8)
    ref_bf16 = transformers_logits(src)
    add("checkpoint", "transformers FP8 ckpt vs transformers bf16 original (FP8 itself)", gap(ref_bf16, ref_fp8))
    for dtype, quant in (("float32", "none"), ("bfloat16", "none"), ("float32", "mxfp8")):
        r = engine_run(fp8, dtype=dtype, quant=quant)
        extra = {}
        if quant == "mxfp8":
            extra["mxfp8_reencode_rel_rms"] = round(r["report"]["mxfp8_reencode_rel_rms_max"], 5)
        add("checkpoint", f"native {dtype}, experts {quant}{' (re-encoded)' if quant == 'mxfp8' else ''} vs transformers",
            gap(ref_fp8, r["logits"]), **extra)
    for part, names in (("LM head only", ("lm_head",)), ("attention only", ("q_proj", "k_proj", "v_proj", "o_proj")),
                        ("attention + LM head", ("lm_head", "q_proj", "k_proj", "v_proj", "o_proj"))):
        add("quant-dense", f"transformers float32, {part} in block FP8 vs none", gap(ref_bf16, transformers_logits(src, fake_quant=names)))
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))  # Gaussian weights, as this model's
    rel = float((dequantize_block_fp8(*quantize_block_fp8(w), torch.float32) - w).norm() / w.norm())
    add("quant-dense", f"control: attention + Gaussian noise of the same RMS ({100 * rel:.2f}%), not FP8",
        gap(ref_bf16, transformers_logits(src, fake_quant=attn, noise=rel)))
    base = {}
    for dtype in ("float32", "bfloat16"):
        base[dtype] = engine_run(src, gen=True, dtype=dtype)
        r = engine_run(src, gen=True, dtype=dtype, quant_dense="fp8")
        add("quant-dense", f"native {dtype}: --quant-dense fp8 vs none", gap(base[dtype]["logits"], r["logits"]),
            **same_prefix(base[dtype]["greedy"], r["greedy"]))
    add("quant-dense", "baseline: native bfloat16 vs float32 (no FP8)", gap(base["float32"]["logits"], base["bfloat16"]["logits"]),
        **same_prefix(base["float32"]["greedy"], base["bfloat16"]["greedy"]))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": "CPU", "torch": torch.__version__, "spec": vars(SPEC),
            "positions_per_row": SEQS * (FOLLOW + 1), "seconds": round(time.perf_counter() - t0, 1)}
    (args.out / "fp8.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, args.out / "fp8.png")
    print(f"wrote {args.out / 'fp8.json'} and fp8.png in {meta['seconds']} s", flush=True)
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.2))
    names = [r["row"] for r in rows][::-1]
    ax.barh(names, [max(100 * r["mean_rel_std"], 1e-7) for r in rows][::-1],
            color=["tab:blue" if r["section"] == "checkpoint" else "tab:orange" for r in rows][::-1])
    ax.set_xscale("log")
    ax.set_xlabel("mean |d logit|, % of the logits' std (log); blue: FP8 checkpoint, orange: --quant-dense")
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
