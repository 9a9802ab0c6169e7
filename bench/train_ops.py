"""What one trainer micro-step dispatches along the GPU code path, counted on any machine.

    TRITON_INTERPRET=1 python bench/train_ops.py [--json]

Builds a small Qwen3-MoE (random weights, float32 masters, bf16 compute as on a GPU, MXFP8 experts through
the served Triton kernels under the interpreter) and runs one optimizer step of one micro-batch under
kernels/op_count.py's OpCounter, one counter per phase (forward, backward, optimizer): aten ops that do
work (views left out) plus Triton launches, by op name, and the host-synchronising ops. Per layer =
(step with 3 layers - step with 1 layer) / 2; the rest is outside the layers (embedding, the casts of the
masters, the LM head's vocabulary slices, the loss). The vocabulary is cut into 10 slices as Qwen3's
151,936 rows are by the default 16,384-row slice. Options of the trainer (TrainerConfig fields) are
counted side by side with the default: see OPTIONS.

Without TRITON_INTERPRET=1 on a CPU the MoE forward's torch reference runs instead of the Triton kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.op_count import OpCounter  # noqa: E402

SMALL = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1280, hidden_size=64,
             intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
             decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=4096,
             rope_theta=1e6, tie_word_embeddings=False, attention_bias=False)
CHUNK = 128  # 10 vocabulary slices, as 151,936 / 16,384 rounds up to

# trainer options measured beside the default (TrainerConfig fields); bench/train_step.py --option too
OPTIONS: dict[str, dict] = {"default": {}, "fused-expert-backward": {"expert_backward": "fused"},
                            "fused-norms": {"fused_norms": True}, "fused-lm-head": {"fused_lm_head": True},
                            "fused-all": {"expert_backward": "fused", "fused_norms": True, "fused_lm_head": True}}


def _count_mxfp8_launches() -> None:
    """kernels/mxfp8_triton.py's quantize/dequantize wrappers do not run inside kernels.launches.launch, so under
    the interpreter the counter would count the interpreter's argument copies (set_, copy_) instead of one
    launch each: wrap them here (a bench-time patch; on a GPU each is one kernel)."""
    from kernels import mxfp8_triton
    from kernels.launches import launch

    for name in ("quantize_mxfp8_triton", "dequantize_mxfp8_triton"):
        fn = getattr(mxfp8_triton, name)
        if getattr(fn, "_counted", False):
            continue

        def wrapped(*a, _fn=fn, _name=name.removesuffix("_triton"), **k):
            with launch(_name):
                return _fn(*a, **k)

        wrapped._counted = True
        setattr(mxfp8_triton, name, wrapped)


def count_step(config: dict, options: dict, seqs: int = 2, length: int = 32) -> dict[str, OpCounter]:
    """One optimizer step on one micro-batch, counted per phase."""
    from kernels.backend import interpreting

    if interpreting():
        _count_mxfp8_launches()
    from bench.train_step import make_samples
    from train.trainer import Trainer, TrainerConfig

    counters: dict[str, OpCounter] = {}

    class Counted(Trainer):
        @contextlib.contextmanager
        def _phase(self, name):
            counter = counters.setdefault(name, OpCounter())
            with counter:
                yield

    folder = Path(tempfile.mkdtemp(prefix="train-ops-"))
    (folder / "config.json").write_text(json.dumps(config))
    tc = TrainerConfig(**{"load_format": "dummy", "dtype": "bfloat16", "device": "cpu", "vocab_chunk": CHUNK,
                          "micro_batch_tokens": seqs * length, **options})
    trainer = Counted(folder, tc)
    samples = make_samples(config["vocab_size"], seqs, length)
    trainer.step(samples, [1.0 if i % 2 else -1.0 for i in range(seqs)])  # warm: checks, caches
    counters.clear()
    trainer.step(samples, [1.0 if i % 2 else -1.0 for i in range(seqs)])
    return counters


def measure(name: str, options: dict, config: dict = SMALL) -> dict:
    layers = config["num_hidden_layers"]
    full = count_step(config, options)
    one = count_step(dict(config, num_hidden_layers=1), options)
    out: dict = {"option": name, "trainer_config": options, "phases": {}}
    for phase in full:
        f, o = full[phase], one[phase]
        ops = Counter(f.ops) + Counter({f"launch:{k}": v for k, v in f.launches.items()})
        ops1 = Counter(o.ops) + Counter({f"launch:{k}": v for k, v in o.launches.items()})
        per_layer = {k: (ops[k] - ops1[k]) / (layers - 1) for k in ops if ops[k] != ops1[k]}
        layer_total = (f.total - o.total) / (layers - 1)
        outside = {k: ops1[k] - per_layer.get(k, 0) for k in ops1 if ops1[k] - per_layer.get(k, 0)}
        out["phases"][phase] = {"per_layer": layer_total, "outside_layers": o.total - layer_total,
                                "total": f.total, "syncs": dict(f.syncs), "layer_ops": per_layer,
                                "outside_ops": outside}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--options", nargs="*", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    results = [measure(n, OPTIONS[n]) for n in args.options]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    print(f"trainer step, one micro-batch, {SMALL['num_hidden_layers']} layers, bf16 compute on float32 masters, "
          f"MXFP8 experts{' (Triton interpreter)' if _interpreting() else ' (torch references: not the GPU path)'}")
    print(f"{'option':24} {'phase':10} {'kernels/layer':>13} {'outside':>8} {'syncs':>6}")
    for r in results:
        for phase, p in r["phases"].items():
            print(f"{r['option']:24} {phase:10} {p['per_layer']:13.1f} {p['outside_layers']:8.1f} "
                  f"{sum(p['syncs'].values()):6d}")
    for r in results:
        for phase, p in r["phases"].items():
            print(f"\n{r['option']} {phase}: per layer " + ", ".join(
                f"{k} {v:g}" for k, v in sorted(p["layer_ops"].items(), key=lambda kv: -kv[1])))
            print(f"{r['option']} {phase}: outside " + ", ".join(
                f"{k} {v:g}" for k, v in sorted(p["outside_ops"].items(), key=lambda kv: -kv[1])))
    return 0


def _interpreting() -> bool:
    from kernels.backend import interpreting

    return interpreting()


if __name__ == "__main__":
    raise SystemExit(main())
