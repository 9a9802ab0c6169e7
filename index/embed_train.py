"""Fine-tune a sentence-transformers bi-encoder on mined (query, definition, hard negative) pairs.

Plain torch on CPU: each step encodes a batch of queries, their definitions and one hard negative per
query, and minimises the in-batch contrastive loss (MultipleNegativesRankingLoss: query i must score
its own definition above the batch's other definitions and every hard negative; cosine x SCALE,
cross-entropy). AdamW with linear warm-up and decay. A wall-clock budget ends training early; the
schedule's horizon follows it: every ten steps the measured step rate says how many steps the budget
still allows, and the decay is laid out to end there (never past the planned steps), so a run the
machine cannot finish still ends at a learning rate near zero instead of being cut at its peak.
The development set is scored `evals_per_epoch` times per epoch's worth of the horizon (the curve).
The model at the end of the schedule is saved (`last`), and the one scored best by `evaluate` (the
development halves, never a test half) beside it (`best`).

Export: `export_fp16` writes the weights as float16 safetensors (half of float32's 90 MB), which
`embed.py` reads back into float32 (NumPy for queries, torch for indexing).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

SCALE = 20.0  # sentence-transformers' MultipleNegativesRankingLoss default


@dataclass(frozen=True)
class Recipe:
    """How the embedder is trained. Every field is recorded next to the model."""

    seed: int = 55
    epochs: int = 1
    batch: int = 32  # queries per step: each sees 2*batch-1 negatives
    lr: float = 5e-5
    warmup: float = 0.1  # share of the planned steps
    max_seq: int = 128  # wordpieces per text while training (queries are shorter)
    threads: int = 2
    budget_min: float = 36.0  # wall-clock minutes for the steps (evaluations excluded)
    hard_negatives: bool = True
    # Matrix products in bfloat16 (autocast; float32 master weights) where the CPU has native bf16
    # units (AVX512-BF16/AMX); elsewhere float32.
    bf16: bool = True
    freeze_embeddings: bool = True  # the word-piece table (12 M of 23 M weights) stays MiniLM's
    evals_per_epoch: int = 2  # points on the development curve per epoch (besides epoch 0)

    def __post_init__(self):
        if self.epochs < 1 or self.evals_per_epoch < 1 or self.batch < 2 or not 0 < self.lr < 1 or not 0 <= self.warmup < 1:
            raise ValueError(f"bad recipe: {self}")
        if not 16 <= self.max_seq <= 512 or self.threads < 1 or self.budget_min <= 0:
            raise ValueError(f"bad recipe: {self}")


def contrastive_loss(q, p, n=None):
    """MultipleNegativesRankingLoss on unit vectors: q [B, D], p [B, D], n [B, D] or None."""
    import torch

    cands = p if n is None else torch.cat([p, n])  # [B or 2B, D]
    scores = SCALE * q @ cands.T  # [B, C]
    return torch.nn.functional.cross_entropy(scores, torch.arange(len(q)))


def train(model, pairs: Sequence, recipe: Recipe, out: Path,
          evaluate: Callable[[object], dict[str, float]], *, log=print) -> dict:
    """Train `model` (a SentenceTransformer) on `pairs` (objects with query/positive/negative).
    `evaluate(model)` returns {"MRR@10": ...} on the development set; it runs before training and
    `recipe.evals_per_epoch` times per epoch (the last at the end). The best model goes to `out/best`;
    the curve to `out/curve.json`."""
    import torch

    torch.manual_seed(recipe.seed)
    random.seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    model.max_seq_length = recipe.max_seq
    rng = random.Random(recipe.seed)
    order = list(range(len(pairs)))
    steps_per_epoch = len(pairs) // recipe.batch
    if steps_per_epoch == 0:
        raise ValueError(f"{len(pairs)} pairs: fewer than one batch of {recipe.batch}")
    total = steps_per_epoch * recipe.epochs
    if recipe.freeze_embeddings:
        for name, prm in model.named_parameters():
            if "word_embeddings" in name:
                prm.requires_grad_(False)
    opt = torch.optim.AdamW([x for x in model.parameters() if x.requires_grad], lr=recipe.lr,
                            weight_decay=0.01)
    from index.embed import _bf16_is_native

    use_bf16 = recipe.bf16 and _bf16_is_native()
    log(f"{len(pairs)} pairs, {total} steps of {recipe.batch}, "
        f"{'bfloat16 autocast' if use_bf16 else 'float32'}, {recipe.threads} threads")
    horizon = [total]  # the step the schedule decays to zero at: `total`, or what the budget allows
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, horizon[0], recipe.warmup))
    curve = []

    def checkpoint(epoch: float, step: int, loss: float | None) -> None:
        model.eval()
        t = time.monotonic()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            res = evaluate(model)  # in the dtype the index embeds with on this CPU
        model.max_seq_length = recipe.max_seq
        curve.append({"epoch": epoch, "step": step, "loss": loss, "lr": recipe.lr * lr_at(step, horizon[0], recipe.warmup),
                      **res, "eval_s": time.monotonic() - t})
        log(f"epoch {epoch:g} step {step}: dev " + ", ".join(f"{k} {v:.1f}" for k, v in res.items())
            + (f", train loss {loss:.3f}" if loss is not None else ""))
        best = max(c["MRR@10"] for c in curve)
        if res["MRR@10"] >= best and epoch > 0:
            model.save(str(out / "best"))
        (out / "curve.json").write_text(json.dumps({"recipe": asdict(recipe), "pairs": len(pairs),
                                                    "curve": curve}, indent=1))
        model.train()

    out.mkdir(parents=True, exist_ok=True)
    checkpoint(0, 0, None)
    t0 = time.monotonic()
    spent = 0.0  # seconds of training steps, evaluations excluded
    step = 0
    stopped = False
    evals = recipe.evals_per_epoch * recipe.epochs  # development points over the horizon, the last at its end
    done_evals = 0
    losses: list[float] = []
    for epoch in range(1, recipe.epochs + 1):
        rng.shuffle(order)
        for b in range(steps_per_epoch):
            ts = time.monotonic()
            batch = [pairs[i] for i in order[b * recipe.batch:(b + 1) * recipe.batch]]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
                q = _embed(model, [x.query for x in batch])
                p = _embed(model, [x.positive for x in batch])
                n = _embed(model, [x.negative for x in batch]) if recipe.hard_negatives else None
            loss = contrastive_loss(q.float(), p.float(), None if n is None else n.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            losses.append(float(loss.detach()))
            spent += time.monotonic() - ts
            if step % 10 == 0:
                was = horizon[0]
                horizon[0] = budget_horizon(step, spent, recipe.budget_min * 60, total)
                if horizon[0] != was:
                    log(f"  the budget allows ~{horizon[0]} of {total} steps: the schedule now ends there")
            sched.step()
            if step % 10 == 0 or step == horizon[0]:
                rate = step * recipe.batch / spent
                left = (horizon[0] - step) * spent / step
                log(f"  step {step}/{horizon[0]} epoch {epoch} loss {sum(losses[-10:]) / len(losses[-10:]):.3f} "
                    f"lr {recipe.lr * lr_at(step, horizon[0], recipe.warmup):.2e} "
                    f"{rate:.1f} pairs/s, {spent / 60:.1f} min, ~{left / 60:.0f} min left")
            if step >= horizon[0] or spent > recipe.budget_min * 60:
                stopped = step < total
                break
            if step >= horizon[0] * (done_evals + 1) / evals and done_evals + 1 < evals:
                done_evals += 1
                checkpoint(round(step / steps_per_epoch, 3), step, sum(losses[-50:]) / len(losses[-50:]))
        if stopped or step >= horizon[0]:
            break
    checkpoint(round(step / steps_per_epoch, 3), step, sum(losses[-50:]) / len(losses[-50:]))
    if stopped:
        log(f"wall-clock budget of {recipe.budget_min} min: stopped at step {step}/{total}")
    model.save(str(out / "last"))
    report = {"recipe": asdict(recipe), "pairs": len(pairs), "steps": step, "planned_steps": total, "horizon": horizon[0],
              "stopped_by_budget": stopped, "train_s": spent, "wall_s": time.monotonic() - t0, "curve": curve}
    (out / "curve.json").write_text(json.dumps(report, indent=1))
    return report


def _embed(model, texts: list[str]):
    feats = model.preprocess(texts) if hasattr(model, "preprocess") else model.tokenize(texts)
    return model(feats)["sentence_embedding"]  # the model's Normalize module makes them unit length


def export_fp16(src: Path, dst: Path, config_from: Path | None = None) -> None:
    """A sentence-transformers folder with `src`'s weights in float16 and only the files loading
    needs. `config_from`: take the configuration and tokenizer files from this folder instead (the
    base model's: fine-tuning changes neither, and the files sentence-transformers 6 writes are
    unknown to older versions and lack the 256-wordpiece limit the index reads)."""
    import os
    import shutil

    from safetensors.numpy import load_file, save_file

    from index.embed import SETTINGS_FILE, weights_sha256

    cfg = config_from or src
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "config_sentence_transformers.json", "modules.json",
                 "sentence_bert_config.json", "special_tokens_map.json", "tokenizer.json",
                 "tokenizer_config.json", "vocab.txt"):
        if (cfg / name).is_file():
            shutil.copyfile(cfg / name, dst / name)
    if (cfg / "1_Pooling").is_dir():
        (dst / "1_Pooling").mkdir(exist_ok=True)
        for f in (cfg / "1_Pooling").iterdir():
            shutil.copyfile(f, dst / "1_Pooling" / f.name)
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v.astype("float16") if v.dtype.kind == "f" else v for k, v in weights.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(dst / "model.safetensors", 0o644)
    # The weights' fingerprint, which indexes record (new weights rebuild them); no fusion yet: that
    # is tuned for these weights afterwards (bench/search_fusion.py --write).
    (dst / SETTINGS_FILE).write_text(json.dumps({"weights_sha256": weights_sha256(dst)}, indent=1) + "\n")


def plot(curve_json: Path, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(curve_json.read_text())
    pts = data["curve"]
    fig, ax = plt.subplots(figsize=(6, 4))
    keys = [k for k in pts[0] if k.startswith("MRR@10")]
    for k in keys:
        ax.plot([p["epoch"] for p in pts], [p[k] for p in pts], marker="o", label=k)
    ax.set_xlabel("epoch (0 = all-MiniLM-L6-v2)")
    ax.set_ylabel("dev MRR@10 (points)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"written {png}", file=sys.stderr)


def budget_horizon(step: int, spent_s: float, budget_s: float, total: int) -> int:
    """The last step the budget allows at the rate measured so far (`step` steps in `spent_s`),
    between the next step and `total`."""
    if step <= 0 or spent_s <= 0:
        return total
    return max(step + 1, min(total, step + int((budget_s - spent_s) * step / spent_s)))


def lr_at(step: int, total: int, warmup: float) -> float:
    """The schedule's learning-rate multiplier (for tests and the report)."""
    warm = max(1, int(total * warmup))
    return min((step + 1) / warm, max(0.0, (total - step) / max(1, total - warm)))

