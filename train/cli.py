"""`composer-train`: RL and SFT on trajectories recorded through the deployed harness. Flags live here only.

    composer-train rl --model DIR --tasks TASKS.jsonl --out RUN [--steps N --max-staleness 1 ...] [--resume]
    composer-train sft --model DIR --out OUT SESSION.jsonl|DIR ...
    composer-train check SESSION.jsonl --model DIR
    composer-train plan --model DIR [--ranks 8 --gpu-memory 80]   # per-GPU memory of a training config
    composer-train export DIR --out OUT [--dtype bf16|fp32]  # a plain copy for tools that read no MXFP8 (transformers)
    composer-train expert-data SUITE --model DIR --out OUT    # token-exact SFT data from the scripted expert
    composer-train recipe tiny --out DIR [--seed S] [--smoke]  # expert data -> tokenizer -> SFT -> RL -> eval -> export

Exit codes: 0 done, 1 a check failed, 2 bad usage or input (the message says which).
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from serve.cli import DTYPES  # what composer-serve serves in (a light import: argparse and the stdlib)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="composer-train", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    rl = sub.add_parser("rl", help="reinforcement learning through the real agent loop")
    rl.add_argument("--model", required=True, help="starting checkpoint (Hugging Face layout)")
    rl.add_argument("--tasks", required=True, help="tasks JSONL (id, workspace, prompt, verify, limits)")
    rl.add_argument("--out", required=True, help="run folder (metrics, trajectories, checkpoints)")
    rl.add_argument("--steps", type=int, default=10)
    rl.add_argument("--group-size", type=int, default=4, help="episodes per task per step (default 4)")
    rl.add_argument("--groups-per-step", type=int, default=2, help="tasks per step (default 2)")
    rl.add_argument("--max-staleness", type=int,
                    help="use an episode at step s only if s - its policy version <= this (0 = synchronous; "
                    "default 1, or 0 with --colocate)")
    rl.add_argument("--workers", type=int, default=4, help="episodes run at once (default 4)")
    rl.add_argument("--overprovision", type=int, default=0,
                    help="groups kept in flight beyond --groups-per-step: a step trains on the first groups to finish "
                    "and carries the rest to the next step (within --max-staleness), not waiting on stragglers")
    rl.add_argument("--lr", type=float, default=1e-5)
    rl.add_argument("--seed", type=int, default=0)
    rl.add_argument("--temperature", type=float, default=1.0)
    rl.add_argument("--max-output-tokens", type=int, default=256, help="max_tokens per model request")
    rl.add_argument("--save-every", type=int, default=5, help="resumable checkpoint every N steps")
    rl.add_argument("--advantage", choices=["grpo", "rloo"], default="grpo")
    rl.add_argument("--aggregation", choices=["token_sum", "token_mean", "seq_mean"], default="token_sum")
    rl.add_argument("--no-mxfp8", action="store_true", help="train and save experts in full precision")
    _numerics_flags(rl)
    rl.add_argument("--config", help="TOML with [loss] and [reward] tables (fields of LossConfig, RewardConfig)")
    rl.add_argument("--base-url", action="append", help="sample from this server instead of launching composer-serve "
                    "(it must support /v1/load_weights and see the run folder); repeat for several servers: "
                    "each episode sticks to the least-loaded one, every one gets the new weights")
    rl.add_argument("--backend", choices=["threads", "processes", "ray"], default="threads",
                    help="where episodes run: threads here, a local process pool, or Ray actors (composer[ray]; "
                    "RAY_ADDRESS joins a cluster); see docs/scaling.md")
    rl.add_argument("--api-key", help="the --base-url server's key")
    rl.add_argument("--vary-environment", action="store_true",
                    help="run each episode in another folder shape, git state and date (as the tiny recipe does)")
    rl.add_argument("--fsdp", action="store_true", help="train with FSDP2 across the ranks of `torchrun "
                    "--nproc-per-node N -m train.cli rl --fsdp ...` (rank 0 runs rollouts and weight sync)")
    rl.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    rl.add_argument("--colocate", action="store_true",
                    help="run the inference engine in this process on the trainer's device: its KV cache freed while "
                    "the trainer steps, the new weights copied into it in memory (no checkpoint written per step); "
                    "synchronous (--max-staleness 0), one device, no --base-url")
    rl.add_argument("--kv-cache-tokens", type=int,
                    help="--colocate: the engine's KV cache in tokens (default: what the memory plan leaves on a GPU, "
                    "the engine's own default on a CPU)")

    sft = sub.add_parser("sft", help="supervised fine-tuning on recorded trajectories (their sampled tokens) and on "
                         "teacher sessions or transcripts without token ids (rendered by the model's chat template)")
    sft.add_argument("sessions", nargs="+", help="session JSONL files, transcript files (JSON or JSONL of OpenAI-style "
                     "message lists with tool calls, {\"messages\": [...], \"tools\": [...]}), or folders of them")
    sft.add_argument("--rerender", action="store_true", help="render every session through the chat template, "
                     "ignoring recorded token ids (as teacher data is)")
    sft.add_argument("--model", required=True)
    sft.add_argument("--out", required=True, help="checkpoint folder to write")
    sft.add_argument("--epochs", type=int, default=1)
    sft.add_argument("--batch", type=int, default=8, help="samples per optimizer step")
    sft.add_argument("--lr", type=float, default=1e-4)
    sft.add_argument("--seed", type=int, default=0)
    sft.add_argument("--no-mxfp8", action="store_true")
    _numerics_flags(sft)

    exp = sub.add_parser("expert-data", help="record the scripted expert solving a suite, token-exact for a model")
    exp.add_argument("suite", help="a synthetic suite name or tasks JSONL with generator tasks")
    exp.add_argument("--model", required=True, help="the checkpoint whose chat format renders the data")
    exp.add_argument("--out", required=True, help="folder: sessions/, results.jsonl, report.json")
    exp.add_argument("--concurrency", type=int, default=4)
    exp.add_argument("--limit", type=int, help="only the first N tasks")

    rec = sub.add_parser("recipe", help="train a model end to end: expert data, tokenizer, SFT, RL, held-out eval, export")
    rec.add_argument("name", choices=["tiny"], help="the recipe (tiny: a few-million-parameter MoE on CPU)")
    rec.add_argument("--out", required=True, help="run folder (stages already done there are skipped)")
    rec.add_argument("--seed", type=int)
    rec.add_argument("--data", help="folder for expert data + tokenizer, shareable between seeds (default OUT/data)")
    rec.add_argument("--smoke", action="store_true", help="toy sizes: every stage runs in about a minute")
    rec.add_argument("--families", help="comma-separated synthetic families")
    rec.add_argument("--sizes", help="comma-separated sizes of the SFT training split (small,medium,large)")
    rec.add_argument("--train-seeds", dest="train_seeds", type=int, help="seeds per family and size for SFT")
    rec.add_argument("--train-seed-base", dest="train_seed_base", type=int,
                     help="first training seed (100000: the training code under fresh names per seed)")
    rec.add_argument("--vocab-size", dest="vocab_size", type=int)
    rec.add_argument("--hidden-size", dest="hidden_size", type=int)
    rec.add_argument("--layers", dest="num_hidden_layers", type=int)
    rec.add_argument("--experts", dest="num_experts", type=int)
    rec.add_argument("--heads", dest="num_attention_heads", type=int)
    rec.add_argument("--kv-heads", dest="num_key_value_heads", type=int)
    rec.add_argument("--moe-intermediate", dest="moe_intermediate_size", type=int, help="width of each expert")
    rec.add_argument("--model-families", dest="model_families", help="comma-separated families SFT, RL and eval use (default all)")
    rec.add_argument("--sft-epochs", dest="sft_epochs", type=int)
    rec.add_argument("--sft-lr", dest="sft_lr", type=float)
    rec.add_argument("--rl-steps", dest="rl_steps", type=int)
    rec.add_argument("--rl-lr", dest="rl_lr", type=float)
    rec.add_argument("--rl-seeds", dest="rl_seeds", type=int,
                     help="RL's tasks: this many training seeds after SFT's (default 2000; 0: SFT's own seeds)")
    rec.add_argument("--rl-sizes", dest="rl_sizes", help="comma-separated sizes RL trains on")
    rec.add_argument("--group-size", dest="rl_group_size", type=int)
    rec.add_argument("--groups-per-step", dest="rl_groups_per_step", type=int)
    rec.add_argument("--advantage", choices=["grpo", "rloo"])
    rec.add_argument("--rl-adam-eps", dest="rl_adam_eps", type=float,
                     help="AdamW epsilon of the RL stage (default 1e-8)")
    rec.add_argument("--negative-weight", dest="rl_negative_weight", type=float,
                     help="scale of negative advantages in RL, 0..1 (default 1: the plain policy gradient)")
    rec.add_argument("--rl-kl-coef", dest="rl_kl_coef", type=float,
                     help="KL penalty (k3) of the RL stage to the SFT policy it starts from (default 0: none)")
    rec.add_argument("--rl-train-only", dest="rl_train_only",
                     help="comma-separated regular expressions of the parameter names RL trains, the rest frozen "
                          "(default: every weight; norm: the RMSNorm gains alone, which took --rl-lr 5e-3)")
    rec.add_argument("--reward", action="append", metavar="KEY=VALUE",
                     help="an RL reward term other than its default (a field of train/rewards.py RewardConfig, e.g. "
                          "evidence_unsupported=0); repeat for several")
    rec.add_argument("--control", choices=["none", "zero", "shuffle"],
                     help="zero: every reward (so every advantage) is 0; shuffle: each episode trains with another "
                          "episode's reward from its step")
    rec.add_argument("--eval-seeds", dest="eval_seeds", type=int, help="held-out seeds per family and size")
    rec.add_argument("--eval-sizes", dest="eval_sizes", help="comma-separated held-out sizes")
    rec.add_argument("--eval-t1", dest="eval_t1", action="store_true", default=None,
                     help="also evaluate held-out at T=1, the temperature RL samples at")
    rec.add_argument("--max-turns", dest="max_turns", type=int, help="model turns per episode (RL and eval)")
    rec.add_argument("--max-output-tokens", dest="max_output_tokens", type=int, help="max_tokens per model request")
    rec.add_argument("--expert-mistakes", dest="expert_mistakes", type=float,
                     help="share of bugfix tasks where the expert's first edit fails and it recovers (SFT learns "
                          "the recovery, not the mistake; default 0)")
    rec.add_argument("--dtype", choices=DTYPES, help="what the recipe's server and its SFT and RL trainers compute "
                     "in (default float32)")
    rec.add_argument("--init", help="start from this checkpoint (same tokenizer) instead of a random model")
    rec.add_argument("--rl-from", dest="rl_from",
                     help="RL from this trained checkpoint (e.g. serve/builtin/composer-tiny), skipping the data and SFT")
    rec.add_argument("--skip-rl", dest="skip_rl", action="store_true", default=None, help="stop after SFT")
    rec.add_argument("--concurrency", type=int, help="episodes at once when recording and evaluating")
    rec.add_argument("--same-environment", dest="vary_environment", action="store_false", default=None,
                     help="record the expert data and run the RL episodes in one kind of folder, outside git, "
                          "on today's date (default: varied, so the model learns to ignore them)")

    chk = sub.add_parser("check", help="verify a trajectory is token-exact for a model; report the log-prob gap")
    chk.add_argument("session", help="session JSONL recorded with --record-tokens")
    chk.add_argument("--model", required=True, help="the checkpoint that served it")
    chk.add_argument("--tolerance", type=float, default=1e-3, help="largest acceptable log-prob gap (default 1e-3)")
    chk.add_argument("--no-mxfp8", action="store_true", help="the server ran full-precision experts")
    chk.add_argument("--json", action="store_true", help="print the report as JSON")
    chk.add_argument("--dtype", choices=DTYPES, help="score in this dtype (default: what the session's requests "
                     "say they were served in, else as the trainer's default)")

    pl = sub.add_parser("plan", help="print the per-GPU memory a training config needs (from config.json alone); "
                        "exit 1 if it does not fit")
    pl.add_argument("--model", required=True, help="checkpoint folder (only config.json is read)")
    pl.add_argument("--ranks", type=int, default=1, help="GPUs the model is sharded over with FSDP2 (default 1: no FSDP)")
    pl.add_argument("--gpu-memory", type=float, help="GiB per GPU (default: this machine's GPU, else its RAM)")
    pl.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: the checkpoint's serve_dtype, else "
                    "bfloat16, as the trainer on a GPU)")
    pl.add_argument("--no-mxfp8", action="store_true")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--colocate", action="store_true", help="with the inference engine on the same device "
                    "(composer-train rl --colocate): its weights, and its KV cache while rollouts run")
    pl.add_argument("--kv-cache-tokens", type=int, help="--colocate: the engine's KV cache (default: what fits)")
    _memory_flags(pl)

    ex = sub.add_parser("export", help="write a checkpoint as plain weights (MXFP8 experts dequantized, exactly "
                        "as served) for tools that cannot read MXFP8, such as transformers")
    ex.add_argument("model", help="checkpoint folder (what composer-train writes, or any Qwen3-MoE checkpoint)")
    ex.add_argument("--out", required=True, help="folder to write (replaced whole if it exists)")
    ex.add_argument("--dtype", choices=EXPORT_DTYPES, default="bf16", help="weights' dtype (default bf16)")
    return p


EXPORT_DTYPES = ("bf16", "fp16", "fp32", "bfloat16", "float16", "float32")


def _numerics_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=DTYPES, help="what the forward computes in (default: the checkpoint's "
                   "serve_dtype, else bfloat16 on a GPU and float32 on a CPU); a server the run launches serves in it")
    p.add_argument("--batch-invariant", action="store_true", help="batch-invariant numerics, trainer and launched "
                   "server both (composer-serve --batch-invariant): log-probs equal bit for bit")
    _memory_flags(p)


def _memory_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--micro-batch-tokens", type=int, default=8192,
                   help="padded tokens per forward; a step accumulates gradients over them (default 8192)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="keep each layer's input only and recompute the layer in the backward (less memory)")



def main(argv: list[str] | None = None) -> int:
    from serve.quiet import hush

    hush()
    args = build_parser().parse_args(argv)
    try:
        return {"rl": _rl, "sft": _sft, "check": _check, "expert-data": _expert_data,
                "recipe": _recipe, "export": _export, "plan": _plan}[args.command](args)
    except (ValueError, FileNotFoundError) as e:  # bad input: a clear message, no traceback
        print(f"composer-train: error: {e}", file=sys.stderr)
        return 2


def _model_dir(path: str) -> Path:
    d = Path(path)
    if not (d / "config.json").is_file():
        raise ValueError(f"{path} is not a checkpoint folder (no config.json)")
    return d


def _plan(args) -> int:
    import torch

    from train.memory_plan import GIB, PlanDoesNotFit, plan_for
    from train.trainer import TrainerConfig, compute_dtype

    model = _model_dir(args.model)
    if args.ranks < 1:
        raise ValueError("--ranks must be at least 1")
    cfg = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, mxfp8_experts=not args.no_mxfp8,
                        activation_checkpointing=args.activation_checkpointing)
    device = "cuda" if args.gpu_memory or torch.cuda.is_available() else "cpu"
    compute = compute_dtype(model, args.dtype, torch.device(device)).itemsize
    if args.kv_cache_tokens is not None and not args.colocate:
        raise ValueError("--kv-cache-tokens sizes the --colocate engine's KV cache: give --colocate too")
    if args.colocate and args.ranks > 1:
        raise ValueError("--colocate plans one process on one device: not with --ranks")
    try:
        if args.colocate:
            from train.colocate import ColocateConfig, colocated_memory_plan
            from train.memory_plan import capacity_bytes

            train = plan_for(model, cfg, compute_bytes=compute, device=device, capacity=float("inf"))
            plan = colocated_memory_plan(model, train, serve_bytes=compute, mxfp8_experts=cfg.mxfp8_experts,
                                         config=ColocateConfig(kv_cache_tokens=args.kv_cache_tokens),
                                         on_gpu=device == "cuda",
                                         capacity=args.gpu_memory * GIB if args.gpu_memory else capacity_bytes(device))
        else:
            plan = plan_for(model, cfg, compute_bytes=compute, world=args.ranks, fsdp=args.ranks > 1,
                            device=device, capacity=args.gpu_memory and args.gpu_memory * GIB)
        advice = None
    except PlanDoesNotFit as e:
        plan, advice = e.plan, e.advice
    print(json.dumps(plan.as_dict() | {"fits": advice is None}, indent=2) if args.json else plan.table())
    if advice:
        print(f"composer-train: {advice}", file=sys.stderr)
    return 0 if advice is None else 1


def _print_plan(model: Path, cfg, fsdp: bool) -> None:
    """One line before training starts: what a rank will need, of what it has (refuses when it cannot fit)."""
    import os

    import torch

    from train.memory_plan import GIB, plan_for
    from train.trainer import compute_dtype

    world = int(os.environ.get("WORLD_SIZE", "1")) if fsdp else 1
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    compute = compute_dtype(model, cfg.dtype, torch.device(device)).itemsize
    plan = plan_for(model, cfg, compute_bytes=compute, world=world, fsdp=fsdp, device=device)
    print(f"composer-train: memory plan {plan.total / GIB:.2f} GiB per {'GPU' if device == 'cuda' else 'process'}"
          f" of {plan.capacity / GIB:.1f} GiB (composer-train plan --model {model} for the table)", file=sys.stderr)


def _export(args) -> int:
    import torch

    from serve.model.loader import load_model
    from train.checkpoint import export_hf

    src, out = _model_dir(args.model), Path(args.out)
    if out.resolve() == src.resolve():
        raise ValueError("--out must differ from the checkpoint it exports")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype) \
        or getattr(torch, args.dtype)
    model = load_model(src, dtype=torch.float32, quant="none")  # MXFP8 experts stay as served
    export_hf(model, src, out, dtype=dtype)
    print(f"{out}: plain {str(dtype).removeprefix('torch.')} checkpoint (transformers: "
          f"AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def _rl(args) -> int:
    from agent.tasks import load_tasks
    from train.algo import LossConfig
    from train.rewards import RewardConfig
    from train.rl import RLConfig, run
    from train.trainer import TrainerConfig

    extra = tomllib.loads(Path(args.config).read_text()) if args.config else {}
    unknown = set(extra) - {"loss", "reward"}
    if unknown:
        raise ValueError(f"{args.config}: unknown tables {sorted(unknown)} (expected [loss], [reward])")
    loss = LossConfig(**{"advantage": args.advantage, "aggregation": args.aggregation, **extra.get("loss", {})})
    reward = RewardConfig.from_dict(extra.get("reward", {}))
    if args.kv_cache_tokens is not None and not args.colocate:
        raise ValueError("--kv-cache-tokens sizes the --colocate engine's KV cache: give --colocate too")
    if args.colocate and (args.fsdp or args.base_url):
        raise ValueError("--colocate runs trainer and engine in one process on one device: not with --fsdp or --base-url")
    staleness = args.max_staleness if args.max_staleness is not None else 0 if args.colocate else 1
    cfg = RLConfig(steps=args.steps, group_size=args.group_size, groups_per_step=args.groups_per_step,
                   max_staleness=staleness, workers=args.workers, seed=args.seed,
                   overprovision=args.overprovision,
                   save_every=args.save_every, temperature=args.temperature, max_output_tokens=args.max_output_tokens,
                   backend=args.backend, vary_environment=args.vary_environment)
    trainer = TrainerConfig(lr=args.lr, seed=args.seed, mxfp8_experts=not args.no_mxfp8, dtype=args.dtype,
                            batch_invariant=args.batch_invariant, micro_batch_tokens=args.micro_batch_tokens,
                            activation_checkpointing=args.activation_checkpointing)
    _print_plan(_model_dir(args.model), trainer, args.fsdp)
    colocate = None
    if args.colocate:
        from train.colocate import ColocateConfig

        colocate = ColocateConfig(kv_cache_tokens=args.kv_cache_tokens)
    leader = None
    if args.fsdp:
        from train.distributed.fsdp import FSDPTrainer, Leader, follow, init_process_group

        rank, _ = init_process_group()
        sharded = FSDPTrainer(_model_dir(args.model), trainer, loss)
        if rank != 0:  # the other ranks train in lockstep with rank 0 and do nothing else
            follow(sharded)
            return 0
        leader = Leader(sharded)
    try:
        history = run(_model_dir(args.model), load_tasks(args.tasks), args.out, cfg, trainer_cfg=trainer, loss=loss,
                      reward=reward, resume=args.resume, base_url=args.base_url, api_key=args.api_key,
                      trainer=leader, colocate=colocate)
    finally:
        if leader is not None:
            leader.stop()
    last = history[-1] if history else {}
    print(f"composer-train: {len(history)} steps; last reward {last.get('reward_mean')}, pass rate "
          f"{last.get('pass_rate')}; metrics in {Path(args.out) / 'metrics.jsonl'}")
    return 0


def _session_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix in (".jsonl", ".json") and f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p} does not exist")
    if not files:
        raise ValueError("no session files given")
    return files


def _sft(args) -> int:
    import random

    from agent.session import load
    from agent.tools import default_registry
    from train.progress import Progress
    from train.samples import build_samples
    from train.trainer import Trainer, TrainerConfig

    model = _model_dir(args.model)
    spec_hash = default_registry().spec_hash()
    from serve.chat_format import ChatFormat
    from train.samples import TrajectoryError, token_requests
    from train.teacher import TeacherError, teacher_samples

    chat = ChatFormat(model)  # refuses sessions rendered by another chat template or tokenizer
    samples, exact, rendered, refused = [], 0, 0, []
    for f in _session_files(args.sessions):
        try:
            data = load(f) if f.suffix == ".jsonl" and _is_session(f) else None
            if data is not None and not args.rerender and _has_ids(data, token_requests):
                samples += build_samples(data, chat=chat, spec_hash=spec_hash)
                exact += 1
            else:  # text only (a teacher's session, a transcript): rendered as composer-serve would
                samples += teacher_samples(f, chat)
                rendered += 1
        except (TrajectoryError, TeacherError) as e:
            refused.append(f"{f}: {e}")
    for why in refused:
        print(f"composer-train: refused {why}", file=sys.stderr)
    print(f"composer-train: {exact} sessions token-exact, {rendered} rendered through {model}'s chat template, "
          f"{len(refused)} refused", file=sys.stderr)
    if not samples:
        raise ValueError("the sessions hold no sampled tokens to train on")
    cfg = TrainerConfig(lr=args.lr, seed=args.seed, mxfp8_experts=not args.no_mxfp8, dtype=args.dtype,
                        batch_invariant=args.batch_invariant, micro_batch_tokens=args.micro_batch_tokens,
                        activation_checkpointing=args.activation_checkpointing)
    _print_plan(model, cfg, fsdp=False)
    trainer = Trainer(model, cfg)
    rng = random.Random(args.seed)
    steps = args.epochs * -(-len(samples) // args.batch)
    progress = Progress(steps, label="sft step")
    step = 0
    for _ in range(args.epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for i in range(0, len(order), args.batch):
            batch = [samples[j] for j in order[i: i + args.batch]]
            m = trainer.step(batch, [0.0] * len(batch), sft=True)
            progress.update({"step": step, **m})
            step += 1
    progress.close()
    trainer.save(args.out, state={"sft_steps": step})
    print(f"composer-train: {step} SFT steps on {len(samples)} samples; wrote {args.out}")
    return 0


def _is_session(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        return json.loads(first).get("type") == "session"
    except (json.JSONDecodeError, AttributeError):
        return False


def _has_ids(data, token_requests) -> bool:
    """Every request carries the server's token ids (else the session is taught from its text)."""
    try:
        return bool(token_requests(data))
    except ValueError:
        return False


def _expert_data(args) -> int:
    from agent.tasks import load_tasks
    from train.expert_data import record

    tasks = [t for t in load_tasks(args.suite) if t.generator]
    if not tasks:
        raise ValueError(f"{args.suite} has no generated tasks: the expert knows only the synthetic families")
    if any(t.split == "heldout" for t in tasks):
        raise ValueError("refusing to make training data from held-out tasks")
    report = record(_model_dir(args.model), tasks[: args.limit] if args.limit else tasks, args.out, args.concurrency)
    print(f"composer-train: {report['overall']['episodes']} expert episodes (pass@1 {report['overall'].get('pass@1')}); "
          f"sessions in {Path(args.out) / 'sessions'}")
    return 0


def _recipe(args) -> int:
    from train.recipe import recipe_from_args, run

    summary = run(recipe_from_args(args), args.out, args.data)
    print(f"composer-train: held-out pass@1 after SFT {summary['sft']['pass@1']}"
          + (f", after RL {summary['rl']['pass@1']}" if "rl" in summary else "")
          + f"; serving checkpoint in {summary['export']}")
    return 0


def _check(args) -> int:
    from agent.session import load
    from serve.chat_format import ChatFormat
    from train.checkpoint import read_policy
    from train.samples import TrajectoryError, build_samples, served_numerics
    from train.trainer import Trainer, TrainerConfig

    model = _model_dir(args.model)
    data = load(Path(args.session))
    chat = ChatFormat(model)
    report: dict = {"session": args.session, "model": str(model)}
    ok = True
    try:
        samples = build_samples(data, chat=chat)
        report["token_identity"] = "ok: every prompt equals the chat format's rendering of its messages"
    except TrajectoryError as e:
        report["token_identity"] = f"FAILED: {e}"
        ok = False
        samples = []
    decode_bad = []
    for rec, msg in _turn_answers(data) if ok else []:
        if (msg.get("content") or "").strip() not in chat.decode(rec["completion_token_ids"]):
            decode_bad.append(rec.get("turn"))
    report["completion_decode"] = "ok" if not decode_bad else f"FAILED at turns {decode_bad}"
    ok = ok and not decode_bad
    report |= {"requests": sum(s.requests for s in samples), "segments": len(samples),
               "sampled_tokens": sum(s.sampled_tokens for s in samples)}
    if samples:
        import torch

        dtype, invariant = served_numerics(data)
        trainer = Trainer(model, TrainerConfig(mxfp8_experts=not args.no_mxfp8, dtype=args.dtype or dtype,
                                               batch_invariant=invariant))
        report |= {"served_dtype": dtype, "batch_invariant": invariant,
                   "scored_dtype": str(trainer.dtype).removeprefix("torch.")}
        gaps = []
        for s, lp in zip(samples, trainer.logprobs(samples), strict=True):
            m = torch.tensor(s.mask[1:]) > 0
            gaps.append((lp[m] - torch.tensor(s.sampler_logprobs[1:])[m]).abs())
        g = torch.cat(gaps)
        versions = sorted({v for s in samples for v in s.versions})
        model_version = int(read_policy(model).get("policy_version", 0))
        report |= {"logprob_gap_max": float(g.max()), "logprob_gap_mean": float(g.mean()),
                   "sampled_by_versions": versions, "model_version": model_version}
        if versions == [model_version] and float(g.max()) > args.tolerance:
            ok = False
    if ok and not samples:  # nothing recorded with --record-tokens: nothing was checked
        report["sampled_tokens_check"] = "FAILED: the session has no sampled tokens to check"
        ok = False
    report["ok"] = ok
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k:>20}: {v}")
    return 0 if ok else 1


def _turn_answers(data) -> list[tuple[dict, dict]]:
    """(turn request, the assistant message it produced: the next one recorded), in one pass."""
    out, pending = [], None
    for r in data.records:
        if r["type"] == "request":
            pending = r if r.get("purpose") == "turn" else None
        elif pending is not None and r["type"] == "message" and r["message"].get("role") == "assistant":
            out.append((pending, r["message"]))
            pending = None
    return out


if __name__ == "__main__":
    sys.exit(main())
