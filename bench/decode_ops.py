"""What one decode step dispatches along the GPU code path, counted on any machine.

    TRITON_INTERPRET=1 python bench/decode_ops.py [--batch 2] [--draft 0] [--moe-fused] [--json]

Builds a small Qwen3-MoE with random weights (MXFP8 experts; no C++ CPU kernels, no oneDNN packing: the
code a GPU runs), prefills a few sequences, then runs decode steps of both paths under
kernels/op_count.py's OpCounter:
- static: the GPU decode step (serve/engine/static_decode.py: forward and sampling on the device);
- eager: ModelRunner.run + sample_batch (steps that mix prefill and decode, and every CPU step).
For each: kernels per layer (aten ops that do work + Triton launches; views left out), those outside
the layers (embedding, rotary, final norm, LM head, sampling), host-synchronising or data-dependent
ops, and whether the op sequence (with shapes) is the same at every context length: static shapes,
what a CUDA graph needs. Per layer = (step with L layers - step with 1 layer) / (L - 1).

--moe-fused: as if this GPU's tuned table (kernels/tuning.py) chose the fused decode MoE kernel (gate_up, SwiGLU
and down in one launch, then the sum of its partials: kernels/moe_decode_variants.py) at every token count up
to 64: a table written to a temporary folder and read as a fake device's.

Without TRITON_INTERPRET=1 on a CPU the kernels' torch references run instead, and the counts are
those of the references, not of the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.op_count import OpCounter  # noqa: E402
from serve.engine.base import SamplingParams  # noqa: E402
from serve.engine.block_manager import BlockManager  # noqa: E402
from serve.engine.model_runner import ModelRunner, StaticConfig  # noqa: E402
from serve.engine.sampling import make_generator, picks_of, sample_batch  # noqa: E402
from serve.engine.sequence import Sequence  # noqa: E402
from serve.model.dummy import random_model  # noqa: E402

SMALL = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512, hidden_size=64,
             intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
             decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=4096,
             rope_theta=1e6, tie_word_embeddings=False, attention_bias=False)
BLOCK = 4


def build(config: dict, quant: str, batch: int, device: str, dtype: torch.dtype = torch.float32, draft: int = 0):
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    model = random_model(folder, device=device, dtype=dtype, quant=quant)
    blocks = BlockManager(64, BLOCK, prefix_caching=False)
    runner = ModelRunner(model, 64, BLOCK, torch.device(device), dtype, None,
                         StaticConfig(max_num_seqs=max(batch, 2), max_model_len=128, graphs=False, max_draft=draft))
    return model, blocks, runner


def prefill(blocks: BlockManager, runner: ModelRunner, batch: int, vocab: int) -> list[Sequence]:
    params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, top_k=20, seed=1, logprobs=True,
                            top_logprobs=3)
    seqs = []
    for i in range(batch):
        seq = Sequence([(7 * i + j) % (vocab - 1) + 1 for j in range(5 + 3 * i)], params)
        seq.generator = make_generator(params)
        assert blocks.allocate(seq)
        runner.run([(seq, len(seq))])
        seq.num_computed = len(seq)
        seq.token_ids.append(1)
        seqs.append(seq)
    return seqs


def step(path: str, blocks: BlockManager, runner: ModelRunner, seqs: list[Sequence], strict: bool,
         draft: int = 0) -> OpCounter:
    """One decode step of every sequence (verifying a `draft`-token draft each, on the static path),
    counted; then the sequences move on by the token drawn after their last one."""
    for seq in seqs:
        seq.draft = [(seq.token_ids[-1] + 1 + i) % 97 + 1 for i in range(draft)] if path == "static" else []
        assert blocks.ensure(seq, len(seq) + len(seq.draft))
    batch = [(seq, 1 + len(seq.draft)) for seq in seqs]
    counter = OpCounter(strict=strict)
    if path == "static":
        with counter:
            out = runner.static._compute(*runner.static.prepare(seqs))
        rows = runner.static.finish(out, sum(n for _, n in batch))
        firsts, r = [], 0
        for seq in seqs:  # the draft is not followed: the sequence moves on by its last token's pick
            firsts.append(rows[r])
            r += 1 + len(seq.draft)
            seq.draft = []
        picks = picks_of(firsts, [s.params for s in seqs], [s.generator for s in seqs])
    else:
        with counter:
            _, logits = runner.run(batch)
            picks = sample_batch(logits, [s.params for s in seqs], [s.generator for s in seqs])
    for seq, pick in zip(seqs, picks, strict=True):
        seq.num_computed += 1
        seq.token_ids.append(pick[0])
    return counter


def measure(path: str, config: dict, quant: str, batch: int, steps: int, device: str,
            dtype: torch.dtype = torch.float32, draft: int = 0) -> dict:
    """Counts of one decode step (the last of `steps`), per layer and outside, and shape staticness."""
    layers = config["num_hidden_layers"]
    totals, counters, signatures = {}, {}, []
    for n_layers in (layers, 1):
        model, blocks, runner = build(dict(config, num_hidden_layers=n_layers), quant, batch, device, dtype, draft)
        seqs = prefill(blocks, runner, batch, config["vocab_size"])
        for _ in range(steps):
            c = step(path, blocks, runner, seqs, strict=False, draft=draft)
            if n_layers == layers:
                signatures.append(c.signature)
        totals[n_layers], counters[n_layers] = c.total, c
    full, one = counters[layers], counters[1]
    per_layer = (totals[layers] - totals[1]) / (layers - 1)
    launches = (sum(full.launches.values()) - sum(one.launches.values())) / (layers - 1)
    layer_ops = {k: (full.ops[k] - one.ops[k]) / (layers - 1) for k in full.ops if full.ops[k] != one.ops[k]}
    layer_ops.update({f"launch:{k}": (full.launches[k] - one.launches[k]) / (layers - 1) for k in full.launches
                      if full.launches[k] != one.launches[k]})
    return {"path": path, "batch": batch, "draft": draft if path == "static" else 0, "kernels_per_layer": per_layer, "launches_per_layer": launches,
            "outside_layers": totals[1] - per_layer, "step_total": totals[layers], "syncs": dict(full.syncs),
            "static_shapes": all(s == signatures[0] for s in signatures), "layer_ops": layer_ops}


def fused_table(config: dict, dtype: torch.dtype) -> Path:
    """A fake device's table naming the fused decode MoE kernel for this model's layer at 1..64 tokens, made
    the one the kernels read (COMPOSER_TUNED_DIR / COMPOSER_TUNED_DEVICE); returns its folder."""
    import os

    from kernels import tuning
    from kernels.moe_decode_variants import KernelTiles, VariantConfig

    folder = Path(tempfile.mkdtemp())
    cfg = VariantConfig("dot", KernelTiles(32, 64), KernelTiles(32, 64), fused=True).to_json()
    dims = dict(D=config["hidden_size"], I=config["moe_intermediate_size"], E=config["num_experts"],
                K=config["num_experts_per_tok"])
    entries = {tuning.shape_key("moe_decode", tuning.dtype_name(dtype), T=T, **dims): cfg for T in range(1, 65)}
    device = "decode-ops-fused-moe"
    tuning.write_table(tuning.Table(device, {"moe_decode": entries}, {"date": "-", "triton": "-"}), folder)
    os.environ[tuning.DIR_ENV], os.environ[tuning.DEVICE_ENV] = str(folder), device
    tuning.reload()
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="decode steps (contexts grow across a block edge)")
    ap.add_argument("--quant", default="mxfp8", choices=["mxfp8", "none"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's dtype (bfloat16 adds the casts a bf16 model does)")
    ap.add_argument("--draft", type=int, default=0,
                    help="static path: each sequence verifies a draft of this many tokens (speculative decoding's "
                         "verify step: a row per token)")
    ap.add_argument("--moe-fused", action="store_true",
                    help="count the fused decode MoE kernel (as a tuned table choosing it would run it)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.moe_fused:
        fused_table(SMALL, dtype)
    results = [measure(p, SMALL, args.quant, args.batch, args.steps, args.device, dtype, args.draft)
               for p in ("static", "eager")]
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"decode step, batch {args.batch}{f' verifying {args.draft} draft tokens each' if args.draft else ''}, {SMALL['num_hidden_layers']} layers, {args.dtype}, experts {args.quant}, "
          f"{args.device}{' (Triton interpreter)' if _interpreting() else ''}"
          f"{', fused decode MoE kernel (a tuned table choosing it)' if args.moe_fused else ''}")
    print(f"{'path':8} {'kernels/layer':>13} {'launches/layer':>14} {'outside':>8} {'syncs':>6}  static shapes")
    for r in results:
        print(f"{r['path']:8} {r['kernels_per_layer']:13.1f} {r['launches_per_layer']:14.1f} "
              f"{r['outside_layers']:8.1f} {sum(r['syncs'].values()):6d}  {r['static_shapes']}")
    for r in results:
        print(f"\n{r['path']}: per layer " + ", ".join(f"{k} {v:g}" for k, v in sorted(r["layer_ops"].items())))
    return 0


def _interpreting() -> bool:
    from kernels.backend import interpreting

    return interpreting()


if __name__ == "__main__":
    raise SystemExit(main())
