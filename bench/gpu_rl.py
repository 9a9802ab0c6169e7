"""Colocated RL steps at a reduced Qwen3-MoE shape: rollout and train throughput, weight hand-over seconds
in memory against the disk path, and where a step's time goes (bench/gpu.py runs this as its "rl" section).

    python bench/gpu_rl.py                        # GPU: 8 layers of Qwen3-30B-A3B (4 where 8 do not fit)
    python bench/gpu_rl.py --json out.json        # CPU: a tiny shape (2 layers, hidden 128, vocabulary 1024)

What runs is `composer-train rl --colocate`'s loop (train/rl.py with train/colocate.py): the native engine
(MXFP8 experts; CUDA graphs on a GPU) and the trainer in this process on one device, random weights made
on the device (load_format dummy) and handed to the engine in memory before the first rollout, synthetic
one-turn tasks through the real agent loop and tools, rewarded by a scripted verifier (a shell coin flip,
so that groups have reward variance and the step has a gradient). The tokenizer is a small BPE trained
here (1,024 tokens): with the 30B vocabulary the model samples ids it does not know, which decode to
nothing; every sampled id is still trained on, as the server returned it.

Per step: rollout seconds and completion tokens/s, trainer seconds (forward / backward / optimizer, from the
trainer's own phase clock) and tokens/s over every token it forwarded, the KV cache's release and restore,
the hand-over. After the run, the same weights handed over once more in memory and once through the disk
(the trainer's save + a second engine's /v1/load_weights path: read, build, swap) at this shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serve.model.config import QWEN3_30B_A3B  # noqa: E402

TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
            num_hidden_layers=2)


def make_folder(shape: dict, folder: Path) -> Path:
    """config.json of `shape` + a small trained BPE and the Hermes chat template: no weights (both sides
    make random ones on the device)."""
    from transformers import PreTrainedTokenizerFast

    from serve.tiny import template_text, train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(1024)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = template_text("hermes")
    fast.save_pretrained(folder)
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    (folder / "config.json").write_text(json.dumps(dict(shape, eos_token_id=eos, pad_token_id=pad)))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, pad], "pad_token_id": pad}))
    return folder


def make_tasks(folder: Path, n: int) -> Path:
    ws = folder / "ws"
    ws.mkdir(parents=True, exist_ok=True)
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    lines = [json.dumps({"id": f"coin-{i}", "workspace": "ws", "prompt": f"fix add in calc.py ({i})",
                         "verify": "test $((RANDOM % 2)) -eq 0", "max_turns": 1}) for i in range(n)]
    (folder / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "tasks.jsonl"


def layers_that_fit(candidates: tuple[int, ...], micro_batch_tokens: int, max_num_seqs: int,
                    capacity: float) -> tuple[int, dict]:
    """The most layers of the 30B shape whose colocated plan fits `capacity`, and each candidate's verdict."""
    from serve.model.config import ModelConfig
    from train.memory_plan import PlanDoesNotFit, colocated_plan, memory_plan

    verdicts = {}
    for layers in candidates:
        d = Path(tempfile.mkdtemp(prefix="bench-rl-plan-"))
        (d / "config.json").write_text(json.dumps(dict(QWEN3_30B_A3B, num_hidden_layers=layers)))
        cfg = ModelConfig.from_dir(d)
        shutil.rmtree(d, ignore_errors=True)
        train = memory_plan(cfg, micro_batch_tokens=micro_batch_tokens)
        try:
            plan = colocated_plan(train, cfg, serve_bytes=2, mxfp8_experts=True, capacity=capacity,
                                  engine_reserve=max_num_seqs * cfg.vocab_size * 48 + 2**30)
            plan.check(capacity)
            verdicts[layers] = f"fits: {plan.total / 2**30:.1f} GiB, KV {plan.kv_tokens} tokens"
            return layers, verdicts
        except PlanDoesNotFit as e:
            verdicts[layers] = f"does not fit: {e.advice}"
    raise RuntimeError(f"no candidate shape fits: {verdicts}")


def measure(*, layers: int | None = None, steps: int | None = None, group_size: int = 4, groups: int | None = None,
            max_output_tokens: int | None = None, log=print) -> dict:
    import torch

    from agent.tasks import load_tasks
    from train.colocate import ColocateConfig, Colocated
    from train.memory_plan import capacity_bytes
    from train.progress import Progress
    from train.rl import RLConfig, run
    from train.trainer import Trainer, TrainerConfig

    cuda = torch.cuda.is_available()
    micro = 8192
    seqs = 64
    verdicts: dict = {}
    if cuda:
        if layers is None:
            layers, verdicts = layers_that_fit((8, 4), micro, seqs, capacity_bytes("cuda"))
        shape = dict(QWEN3_30B_A3B, num_hidden_layers=layers)
    else:
        shape = dict(QWEN3_30B_A3B, **TINY) | ({"num_hidden_layers": layers} if layers else {})
    steps = steps or 3
    groups = groups or (4 if cuda else 1)
    max_output_tokens = max_output_tokens or (256 if cuda else 8)
    root = Path(tempfile.mkdtemp(prefix="bench-rl-"))
    try:
        folder = make_folder(shape, root / "model")
        tasks = load_tasks(make_tasks(root / "tasks", groups * 2))

        class Counting(Trainer):  # what the loop hands the trainer: every token it forwards, its phase clock
            forwarded: list[int] = []
            phases: list[dict] = []

            def step(self, samples, advantages, sft=False):
                self.forwarded.append(sum(len(s.token_ids) for s in samples))
                self.phase_times = {}
                out = super().step(samples, advantages, sft)
                self.phases.append({k: round(v, 4) for k, v in self.phase_times.items()})
                return out

        t0 = time.perf_counter()
        trainer = Counting(folder, TrainerConfig(load_format="dummy", lr=1e-6, micro_batch_tokens=micro))
        built_s = time.perf_counter() - t0
        cfg = RLConfig(steps=steps, group_size=group_size, groups_per_step=groups, workers=group_size * groups,
                       max_staleness=0, save_every=10**6, max_output_tokens=max_output_tokens, temperature=1.0)
        colo_cfg = ColocateConfig(max_num_seqs=seqs if cuda else 8, max_model_len=8192,
                                  kv_cache_tokens=None if cuda else 16384)
        t1 = time.perf_counter()
        hist = run(folder, tasks, root / "run", cfg, trainer=trainer, colocate=colo_cfg,
                   progress=Progress(steps, out=open("/dev/null", "w")))  # noqa: SIM115
        loop_s = time.perf_counter() - t1
        rows = []
        for m, fwd, ph in zip(hist, trainer.forwarded, trainer.phases, strict=False):
            step_s = m["rollout_s"] + m["train_s"] + m["sync_s"] + m.get("sleep_s", 0.0)
            rows.append({"step": m["step"], "episodes": m["episodes"], "completion_tokens": m["completion_tokens"],
                         "rollout_s": m["rollout_s"], "rollout_tok_s": round(m["completion_tokens"] / m["rollout_s"], 1),
                         "train_s": m["train_s"], "train_tokens": fwd, "train_tok_s": round(fwd / m["train_s"], 1),
                         "phases_s": ph, "sleep_s": round(m["sleep_s"], 4), "hand_over_s": round(m["hand_over_s"], 4),
                         "wake_s": round(m["wake_s"], 4), "kv_freed_bytes": m["kv_freed_bytes"],
                         "kv_moved": m["kv_moved"], "step_s": round(step_s, 3),
                         "logprob_gap_max": m.get("logprob_gap_max")})
            log(f"rl step {m['step']}: rollouts {m['rollout_s']:.2f} s ({rows[-1]['rollout_tok_s']} completion tok/s), "
                f"train {m['train_s']:.2f} s ({rows[-1]['train_tok_s']} tok/s), hand-over {m['hand_over_s']:.3f} s, "
                f"KV release {m['sleep_s']:.3f} s / restore {m['wake_s']:.3f} s")
        del hist
        free()
        # a fresh engine (the loop's is stopped) with a small KV cache: the disk path's second engine must fit too
        colo = Colocated(folder, trainer, replace(colo_cfg, kv_cache_tokens=colo_cfg.max_model_len))
        try:
            comparison = compare_hand_over(colo, trainer, root, log)
            engine = {"kv_cache_bytes": colo.engine.kv_cache_bytes, "describe": colo.engine.describe()}
        finally:
            colo.stop()
        later = rows[1:] or rows
        return {"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": shape, "layers_tried": verdicts,
                "build_s": round(built_s, 2),
                "loop_s": round(loop_s, 2), "steps": rows, "engine": engine,
                "plan": colo.plan.as_dict() if colo.plan is not None else None,
                "median": {k: statistics.median(r[k] for r in later)
                           for k in ("rollout_tok_s", "train_tok_s", "hand_over_s", "step_s", "rollout_s", "train_s")},
                "hand_over": comparison}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare_hand_over(colo, trainer, root: Path, log) -> dict:
    """The current weights into the engine in memory, against the disk path at this shape: the trainer's
    save (what rl.py writes each step without --colocate) and a second engine's load_weights (read, build a
    model, prepare it, swap), as composer-serve's /v1/load_weights runs it."""
    from serve.engine.native import EngineConfig, NativeEngine

    memory = []
    for _ in range(3):
        trainer.policy_version += 1  # a new version each time, as after a step
        memory.append(colo.hand_over()["hand_over_s"])
    t0 = time.perf_counter()
    saved = trainer.save(root / "disk" / "v1", resumable=False)
    save_s = time.perf_counter() - t0
    e = colo.engine.config
    other = NativeEngine(str(saved), EngineConfig(dtype=e.dtype, quant=colo.engine.quant, max_model_len=e.max_model_len,
                                                  max_num_seqs=e.max_num_seqs, kv_cache_tokens=e.max_model_len,
                                                  device=e.device))
    try:
        t0 = time.perf_counter()
        loaded = asyncio.run(other.load_weights(str(saved), trainer.policy_version + 1))
        load_s = time.perf_counter() - t0
    finally:
        asyncio.run(other.stop())
    row = {"memory_s": round(statistics.median(memory), 4), "memory_runs_s": [round(x, 4) for x in memory],
           "memory_first_s": round(colo.first_hand_over["hand_over_s"], 4), "bytes_written": colo.first_hand_over["bytes"],
           "disk_save_s": round(save_s, 3), "disk_load_s": round(load_s, 3), "disk_engine_load_s": round(loaded.load_s, 3),
           "disk_s": round(save_s + load_s, 3), "checkpoint_bytes": sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())}
    row["disk_over_memory"] = round(row["disk_s"] / row["memory_s"], 1) if row["memory_s"] > 0 else None
    log(f"hand-over at this shape: in memory {row['memory_s']:.4f} s; through the disk {row['disk_s']:.3f} s "
        f"(save {save_s:.3f} + load {load_s:.3f}), {row['disk_over_memory']}x")
    return row


def hand_over_only(shape: dict, log=print) -> dict:
    """The hand-over alone (no RL step) at `shape`: a trainer and its colocated engine, in memory against
    the disk path (compare_hand_over). For shapes whose AdamW state would not fit a CPU box."""
    import torch

    from train.colocate import ColocateConfig, Colocated
    from train.trainer import Trainer, TrainerConfig

    root = Path(tempfile.mkdtemp(prefix="bench-rl-hand-over-"))
    try:
        folder = make_folder(shape, root / "model")
        trainer = Trainer(folder, TrainerConfig(load_format="dummy"))
        colo = Colocated(folder, trainer, ColocateConfig(max_num_seqs=4, max_model_len=1024, kv_cache_tokens=1024))
        try:
            row = compare_hand_over(colo, trainer, root, log)
        finally:
            colo.stop()
        params = sum(p.numel() for p in trainer.model.parameters())
        return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "shape": shape,
                "parameters": params, "hand_over": row}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def plot(result: dict, png: Path) -> Path | None:
    """Each step's time by phase (stacked), and the hand-over in memory against the disk path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = result["steps"]
    parts = [("rollouts", lambda r: r["rollout_s"])] + [
        (f"train {k}", lambda r, k=k: r["phases_s"].get(k, 0.0)) for k in ("forward", "backward", "optimizer")] + [
        ("KV release", lambda r: r["sleep_s"]), ("hand-over", lambda r: r["hand_over_s"]),
        ("KV restore", lambda r: r["wake_s"])]
    bottom = [0.0] * len(steps)
    for name, get in parts:
        vals = [get(r) for r in steps]
        a.bar([r["step"] for r in steps], vals, bottom=bottom, label=name)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    a.set_xlabel("step")
    a.set_ylabel("seconds")
    a.set_title(f"colocated RL step ({result['device']}, {result['shape']['num_hidden_layers']} layers)")
    a.legend(fontsize=7)
    h = result["hand_over"]
    b.bar(["in memory", "disk: save", "disk: load"], [h["memory_s"], h["disk_save_s"], h["disk_load_s"]],
          color=["tab:green", "tab:red", "tab:orange"])
    b.set_ylabel("seconds")
    b.set_title(f"weight hand-over ({h['bytes_written'] / 2**20:.1f} MiB written): disk/memory {h['disk_over_memory']}x")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, help="layers of the 30B shape (GPU default: 8, or 4 where 8 do not fit)")
    p.add_argument("--steps", type=int, help="RL steps (default 3)")
    p.add_argument("--json", type=Path, help="write the figures here (and a plot beside it, .png)")
    p.add_argument("--hand-over-only", action="store_true",
                   help="only the hand-over, in memory against the disk path, at --layers of the 30B shape with "
                   "--experts experts and --vocab tokens (for a CPU: no AdamW state, no rollouts)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    args = p.parse_args(argv)
    if args.hand_over_only:
        shape = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers or 1, num_experts=args.experts,
                     vocab_size=args.vocab)
        result = hand_over_only(shape)
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
        return 0
    result = measure(layers=args.layers, steps=args.steps)
    print(json.dumps(result["median"] | {"hand_over": result["hand_over"]}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
        plot(result, args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
