"""`composer-train recipe tiny`: a small Qwen3-MoE trained end to end on CPU through the real harness.

    expert data   the scripted expert solves the training split of the synthetic families through the
                  real agent loop, recorded token-exact (train/expert_data.py)
    tokenizer     a byte-level BPE trained with `tokenizers` on those conversations as the chat template
                  renders them (system prompt, tool specs, tool results), so the vocabulary fits the text
    base          a random Qwen3-MoE with that tokenizer and our ChatML template with Hermes tool calls
    sft           warm start on the expert's sampled tokens (AdamW, warm-up + cosine)
    rl            GRPO/RLOO with the length penalty, async with staleness 1 (train/rl.py) on the train split,
                  every weight, 16 episodes a task (rl_group_size), lr 1e-4
    eval          held-out split (seeds >= 1e6) with the eval runner, greedy, after SFT and after RL
    export        the serving folder (HF layout, MXFP8 experts, composer_policy.json) in OUT/export

The tokenizer splits only at line ends, not at words ("no regex"): the fixed part of every prompt (the
system prompt and ~8 kB of tool specs) then costs tens of tokens instead of thousands, which is what
makes training and rollouts affordable on 2 CPU cores. Expert data and tokenizer depend on the task set
only, not on --seed, so runs of several seeds can share them (--data). Every stage leaves its output
in OUT and is skipped when it is already there, so an interrupted recipe continues where it stopped.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

# pytest in the episodes' workspaces would otherwise import every plugin of this environment
# (~4 s per run on 2 cores; the synthetic repositories use none of them).
PYTEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
EXPORT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "composer_policy.json",
    "README.md",
)


@dataclass
class TinyRecipe:
    seed: int = 0
    """Initialisation, data order, RL task order."""
    families: tuple[str, ...] = ("bugfix", "find-def", "rename", "add-param")
    train_seeds: int = 40
    """Synthetic seeds BASE..BASE+N-1 of each family and size make the training split."""
    train_seed_base: int = 0
    """BASE: 0 trains on the training pool's own 25 function names; 100,000 (families.RENAMED_BASE) on
    the same code under fresh names per seed, so that answers cannot come from memorised names."""
    sizes: tuple[str, ...] = ("small", "medium")
    tokenizer_seeds: int = 6
    """Seeds whose expert conversations the tokenizer is trained on."""
    vocab_size: int = 4096
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    model_families: tuple[str, ...] | None = None
    """Families the model is trained (SFT, RL) and evaluated on (default: all of `families`, which the
    expert data covers)."""
    sft_epochs: int = 4
    sft_batch: int = 8
    sft_lr: float = 2e-3
    rl_steps: int = 25
    rl_sizes: tuple[str, ...] = ("small",)
    rl_seeds: int | None = 2000
    """RL's tasks: this many training-split seeds right after SFT's (BASE+N .. BASE+N+rl_seeds-1), so RL
    never replays a task whose expert answer SFT memorised. There the memorised answer is right and a
    reward teaches recall; on fresh tasks the same bug on other lines rewards reading the file. None:
    RL on SFT's own seeds."""
    rl_group_size: int = 16
    """Episodes per task: 16, so that the tasks the policy mostly fails still show a success to learn from
    (with 4, 56% of groups had all-equal rewards and no advantage)."""
    rl_groups_per_step: int = 4
    rl_save_every: int = 10
    """RL checkpoints (weights, optimizer, RNG, task cursor) every this many steps: a killed recipe resumes its
    RL stage from the last one instead of step 0."""
    rl_lr: float = 1e-4
    """The RL stage's AdamW learning rate, for every weight (the default `rl_train_only`); the RMSNorm gains
    alone took 5e-3."""
    rl_workers: int = 4
    advantage: str = "grpo"
    rl_negative_weight: float = 1.0
    """LossConfig.negative_weight of the RL stage."""
    rl_adam_eps: float = 1e-8
    """TrainerConfig.eps of the RL stage."""
    rl_kl_coef: float = 0.0
    """LossConfig.kl_coef of the RL stage: the KL penalty (k3) to the SFT policy, the weights RL starts from."""
    rl_train_only: tuple[str, ...] = ()
    """TrainerConfig.train_only of the RL stage: regular expressions of the parameters RL trains, the rest
    frozen; () (the default) trains every weight. With 16 episodes a task and lr 1e-4, RL on every weight
    raised greedy held-out pass@1 over SFT on 3 seeds (0.587 -> 0.673-0.713) while its shuffled-reward
    control fell (0.480); with 4 episodes a task, every-weight runs lost to noise what the reward taught,
    and ("norm",), the RMSNorm gains alone, only sharpened sampling at T=1 (BENCHMARKS.md)."""
    reward: dict[str, Any] = field(default_factory=dict)
    """RL's reward terms that differ from RewardConfig's defaults (train/rewards.py), e.g.
    {"evidence_unsupported": 0, "evidence_contradicted": 0} for a run without the evidence term."""
    control: str = "none"
    """Control runs: "zero" zeroes every reward (so every advantage, and the optimizer does not move);
    "shuffle" trains each episode with another episode's reward (RLConfig.shuffle_rewards); "none": the
    real run."""
    eval_seeds: int = 15
    """Held-out seeds 1e6..1e6+N-1 of each family, eval sizes."""
    eval_sizes: tuple[str, ...] = ("small",)
    eval_t1: bool = False
    """Also evaluate held-out at T=1 (the temperature RL samples at), besides greedy."""
    max_output_tokens: int = 160
    max_turns: int = 8
    concurrency: int = 2
    skip_rl: bool = False
    init: str | None = None
    """Start from this checkpoint (same tokenizer) instead of a random model."""
    rl_from: str | None = None
    """RL from this checkpoint (e.g. the built-in model): it is copied as OUT/sft, and tokenizer, expert
    data, base and SFT are skipped."""
    vary_environment: bool = True
    """Record the expert data (and the tokenizer's corpus) and run the RL episodes in varied folders, git
    states and dates (agent/tasks/variation.py), so the model does not tie its answers to one workspace
    path or day."""
    dtype: str = "float32"
    """What the recipe's composer-serve and its SFT and RL trainers compute in. float32 by default (a CPU's
    default); bfloat16 or float16 train and serve in low precision, the trainer in the dtype served
    (issue 40). bench/tiny_heldout.py evaluates in float64, as the built-in model is served, whatever this is."""
    expert_mistakes: float = 0.0
    """Share of the one-edit tasks (bugfix) where the expert's first edit misremembers the line (an
    old_string the file does not have) and the next turn recovers by copying it as the edit tool's error
    shows it. SFT learns the recovery, never the mistake (a turn with a failed call is context)."""
    vary_timings: bool = True
    """SFT sees each expert episode, each epoch, with its tool results timed as on a machine of another
    speed (train/timings.py), so a slower or busier machine than the recording one does not derail it."""

    @classmethod
    def smoke(cls, **kw: Any) -> TinyRecipe:
        """A toy size for CI: every stage runs, nothing is expected to be learned."""
        base = dict(
            train_seeds=1,
            sizes=("small",),
            tokenizer_seeds=1,
            vocab_size=2048,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=4,
            moe_intermediate_size=32,
            sft_epochs=3,
            sft_batch=2,
            sft_lr=3e-3,
            rl_steps=2,
            rl_group_size=2,
            rl_groups_per_step=1,
            rl_workers=2,
            rl_seeds=2,
            rl_save_every=1,
            eval_seeds=1,
            max_output_tokens=24,
            max_turns=2,
            families=("find-def", "rename"),
        )
        return cls(**(base | kw))

    def model_spec(self) -> dict[str, Any]:
        return {
            f: getattr(self, f)
            for f in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
            )
        }


def say(msg: str) -> None:
    print(f"[recipe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- tasks ------------------------------------------------------------------------------------------------


def train_tasks(r: TinyRecipe, seeds: int | None = None, sizes: tuple[str, ...] | None = None, skip: int = 0,
                families: tuple[str, ...] | None = None):
    """The training split: seeds BASE+skip .. BASE+skip+seeds-1 (seeds: r.train_seeds) of each family and size."""
    from agent.tasks.families import generate

    first = r.train_seed_base + skip
    return [
        generate(f, s, size, "train")
        for s in range(first, first + (seeds if seeds is not None else r.train_seeds))
        for f in (families or r.families)
        for size in (sizes or r.sizes)
    ]


def rl_tasks(r: TinyRecipe):
    """RL's tasks of the model's families: the training split's seeds after SFT's (r.rl_seeds of them),
    or SFT's own (None)."""
    fams = r.model_families or r.families
    if r.rl_seeds is None:
        return train_tasks(r, sizes=r.rl_sizes, families=fams)
    return train_tasks(r, seeds=r.rl_seeds, sizes=r.rl_sizes, skip=r.train_seeds, families=fams)


def heldout_tasks(r: TinyRecipe):
    from agent.tasks.families import generate
    from agent.tasks.suites import HELDOUT_BASE

    return [
        generate(f, HELDOUT_BASE + s, size, "heldout")
        for s in range(r.eval_seeds)
        for f in r.model_families or r.families
        for size in r.eval_sizes
    ]


def distinct_prompt_parts(tasks) -> list[list]:
    """Tasks split into as few parts as needed so that no two tasks of a part share a prompt."""
    parts: list[tuple[set[str], list]] = []
    for t in tasks:
        part = next((p for p in parts if t.prompt not in p[0]), None)
        if part is None:
            part = (set(), [])
            parts.append(part)
        part[0].add(t.prompt)
        part[1].append(t)
    return [p[1] for p in parts]


def _limit_turns(tasks, r: TinyRecipe):
    from dataclasses import replace

    return [replace(t, max_turns=min(t.max_turns, r.max_turns)) for t in tasks]


# -- tokenizer and base model ------------------------------------------------------------------------------


def _save_tokenizer(tok, out: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    from serve.tiny import template_text

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=16384
    )
    fast.chat_template = template_text("hermes")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]})
    )
    return out


def provisional_tokenizer(out: Path) -> Path:
    """Any tokenizer will do to record the conversations the real one is trained on."""
    from serve.tiny import train_tokenizer

    return _save_tokenizer(train_tokenizer(1024, max_bytes=100_000), out)


def conversation_texts(sessions_dir: Path, chat) -> list[str]:
    """Each recorded conversation as the chat template renders it (the last request + its answer)."""
    from agent.session import load

    texts = []
    for f in sorted(sessions_dir.glob("*.jsonl")):
        data = load(f)
        reqs = list(data.requests())
        if not reqs:
            continue
        tools = data.meta.get("tools") or None
        texts += [
            chat.render(sent, tools if rec.get("purpose", "turn") == "turn" else None, True)
            + chat.decode(rec.get("completion_token_ids") or [])
            for rec, sent in reqs[-1:]
        ]
    return texts


def train_bpe(texts: list[str], vocab_size: int):
    """Byte-level BPE whose tokens may span words but not lines (see the module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from serve.tiny import SPECIAL_TOKENS, TEXT_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="merged_with_previous"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TEXT_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        max_token_length=48,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    return tok


def build_base(out: Path, tokenizer_dir: Path, r: TinyRecipe) -> Path:
    """A randomly initialised Qwen3-MoE (transformers' own init) with the recipe's tokenizer."""
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    spec = r.model_spec() | {"vocab_size": tok.get_vocab_size()}
    config = Qwen3MoeConfig(
        **spec,
        intermediate_size=4 * r.hidden_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=eos[0],
        pad_token_id=eos[1],
        dtype="float32",
    )
    torch.manual_seed(r.seed)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(out)
    gen = {"eos_token_id": eos, "pad_token_id": eos[1], "temperature": 1.0, "top_p": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def n_params(model_dir: Path) -> int:
    """Parameters of the checkpoint (experts counted once, as stored in full precision)."""
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())


# -- SFT ----------------------------------------------------------------------------------------------------


def sft(model_dir: Path, sessions: Path, out: Path, r: TinyRecipe) -> list[dict[str, Any]]:
    """Supervised warm start; per-step metrics in OUT/../sft_metrics.jsonl. Returns them."""
    import math

    from agent.session import load
    from agent.tools import default_registry
    from serve.chat_format import ChatFormat
    from train.progress import Progress
    from train.samples import build_samples
    from train.timings import vary_timings
    from train.trainer import Trainer, TrainerConfig

    chat = ChatFormat(model_dir)
    spec_hash = default_registry().spec_hash()
    files = [
        f
        for f in sorted(sessions.rglob("sessions/*.jsonl"))
        if not r.model_families or any(f.name.startswith(fam + "-") for fam in r.model_families)
    ]
    episodes = [load(f) for f in files]
    # a turn whose tool call failed is context, not a target: the expert's deliberate mistakes
    recorded = [build_samples(data, chat=chat, spec_hash=spec_hash, train_failed=False) for data in episodes]
    samples = [s for ep in recorded for s in ep]
    if not samples:
        raise ValueError(f"{sessions} holds no expert samples")
    trainer = Trainer(model_dir, TrainerConfig(lr=r.sft_lr, seed=r.seed, weight_decay=0.01, dtype=r.dtype))
    rng = random.Random(r.seed)
    per_epoch = -(-len(samples) // r.sft_batch)
    total = r.sft_epochs * per_epoch
    warmup = max(1, total // 20)
    progress = Progress(total, label="sft step")
    metrics_path = out.parent / "sft_metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    history, step = [], 0
    timing_rng = random.Random(f"timings/{r.seed}")
    for epoch in range(r.sft_epochs):
        if r.vary_timings:  # each epoch sees the episodes as machines of other speeds would have timed them
            varied = [vary_timings(data, chat, timing_rng) for data in episodes]  # the same object: kept as recorded
            samples = [s for data, v, ep in zip(episodes, varied, recorded, strict=True)
                       for s in (ep if v is data else build_samples(v, spec_hash=spec_hash, train_failed=False))]
        order = list(range(len(samples)))
        rng.shuffle(order)
        for i in range(0, len(order), r.sft_batch):
            lr = r.sft_lr * (
                min(1.0, (step + 1) / warmup)
                if step < warmup
                else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
            )
            for g in trainer.optimizer.param_groups:
                g["lr"] = lr
            batch = [samples[j] for j in order[i : i + r.sft_batch]]
            m = trainer.step(batch, [0.0] * len(batch), sft=True)
            # loss is the sum of log-likelihood over the batch / its tokens: the per-token NLL
            row = {
                "step": step,
                "epoch": epoch,
                "loss": round(m["loss"], 5),
                "lr": lr,
                "train_tokens": m["train_tokens"],
                "train_s": m["train_s"],
            }
            history.append(row)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            progress.update(row)
            step += 1
    progress.close()
    trainer.policy_version = 0  # RL counts policy versions (and staleness) from the warm start
    trainer.save(out, resumable=False)
    from train.plot import plot_metrics

    plot_metrics(metrics_path, out.parent / "sft_metrics.png")
    return history


# -- evaluation ---------------------------------------------------------------------------------------------


class Served:
    """One composer-serve for the whole recipe (starting one costs ~10 s): launched on the first model,
    then switched with /v1/load_weights (RL samples from it too)."""

    def __init__(self, log_path: Path, dtype: str = "float32"):
        # the recipe's dtype: what its trainers compute in; bench/tiny_heldout.py serves float64, as the
        # built-in model is
        self.log_path, self.dtype, self.server, self.current = log_path, dtype, None, None

    def serve(self, model_dir: Path):
        from train.checkpoint import read_policy
        from train.server import cpu_share, launch

        if self.server is None:
            # RL samples from it while training (staleness 1): on CPU each takes half the cores
            self.server = launch(model_dir, "--dtype", self.dtype, name="policy", log_path=self.log_path,
                                 threads=cpu_share())
        elif model_dir != self.current:
            self.server.load_weights(model_dir, int(read_policy(model_dir).get("policy_version", 0)))
        self.current = model_dir
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def evaluate(server, tasks, out: Path, r: TinyRecipe, temperature: float = 0.0) -> dict[str, Any]:
    """Episodes of `tasks` (greedy by default) through the eval runner against `server`, plus what the
    report lacks: malformed tool calls per episode and tokens per solved task of each family."""
    from agent.config import Config
    from agent.session import load
    from agent.tasks.eval import EvalConfig, run_eval
    from train.rewards import episode_stats

    out.mkdir(parents=True, exist_ok=True)
    config = Config(
        base_url=server.base_url,
        model=server.model,
        api_key=server.api_key,
        temperature=temperature,
        max_output_tokens=r.max_output_tokens,
        max_retries=2,
    )
    report = run_eval(
        _limit_turns(tasks, r), config, EvalConfig(concurrency=r.concurrency, sandbox=False), out
    )
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    malformed, solved_tokens, claims = [], {}, []
    for row in rows:
        if row.get("infra_error") or not row.get("session_path"):
            continue
        stats = episode_stats(load(Path(row["session_path"])), bool(row["passed"]))
        malformed.append(stats.malformed_tool_calls)
        claims.append((stats.claims, stats.unsupported_claims + stats.contradicted_claims, stats.contradicted_claims))
        if row["passed"]:
            solved_tokens.setdefault(row["family"], []).append(row["completion_tokens"])
    report["malformed_per_episode"] = round(sum(malformed) / max(1, len(malformed)), 3)
    # claims of the final answers the episode's own tool log does not support (agent/tasks/claims.py)
    n = max(1, len(claims))
    report["claims"] = {"per_episode": round(sum(c[0] for c in claims) / n, 3),
                        "unsupported_per_episode": round(sum(c[1] for c in claims) / n, 3),
                        "contradicted_per_episode": round(sum(c[2] for c in claims) / n, 3),
                        "episodes_with_unsupported": round(sum(c[1] > 0 for c in claims) / n, 4)}
    report["tokens_per_solved"] = {f: round(sum(v) / len(v), 1) for f, v in sorted(solved_tokens.items())}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def headline(report: dict[str, Any]) -> dict[str, Any]:
    o = report["overall"]
    return {
        "pass@1": o.get("pass@1"),
        "families": {f: b.get("pass@1") for f, b in report["families"].items()},
        "malformed_per_episode": report.get("malformed_per_episode"),
        "tool_calls_per_turn": o.get("tool_calls_per_turn"),
        "completion_tokens": o.get("completion_tokens"),
        "tokens_per_solved": report.get("tokens_per_solved"),
        "infra_errors": o.get("infra_errors"),
        "turns": o.get("turns"),
        "tool_calls": o.get("tool_calls"),
        "claims": report.get("claims"),
    }


# -- the recipe ---------------------------------------------------------------------------------------------


def run(r: TinyRecipe, out: str | Path, data: str | Path | None = None) -> dict[str, Any]:
    """Every stage (skipping those already done); returns OUT/summary.json's content."""
    os.environ.update(PYTEST_ENV)
    if r.rl_from and (r.skip_rl or r.init):
        raise ValueError("--rl-from starts RL from a trained checkpoint: it goes with neither --skip-rl nor --init")
    if r.rl_from and not all((Path(r.rl_from) / f).is_file() for f in ("config.json", "model.safetensors")):
        raise FileNotFoundError(f"--rl-from {r.rl_from}: not a checkpoint folder (no config.json and model.safetensors)")
    reward_config(r)  # a bad reward term is an error now, not after the stages before RL
    out = Path(out)
    data = Path(data) if data else out / "data"
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.json").write_text(json.dumps(asdict(r), indent=2))
    timings: dict[str, float] = {}
    summary: dict[str, Any] = {"recipe": asdict(r)}

    def stage(name: str, done: Path, fn) -> None:
        if done.exists():
            say(f"{name}: already done ({done})")
            return
        say(f"{name} ...")
        t0 = time.monotonic()
        fn()
        timings[name] = round(time.monotonic() - t0, 1)
        say(f"{name}: done in {timings[name]:.0f}s")

    if r.rl_from:
        sft_dir = _copy_rl_start(Path(r.rl_from), out / "sft", stage)
        summary["params"] = n_params(sft_dir)
        say(f"model: {summary['params']:,} parameters, from {r.rl_from}")
    else:
        sft_dir = _sft_stages(r, out, data, stage, summary)
    _eval_and_rl(r, out, sft_dir, stage, summary, timings)
    return summary


def _copy_rl_start(src: Path, sft_dir: Path, stage) -> Path:
    """The checkpoint RL starts from, copied whole into the run folder (the source is never written)."""

    def copy() -> None:
        tmp = sft_dir.with_name(sft_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        os.replace(tmp, sft_dir)

    stage("sft (copied)", sft_dir / "model.safetensors", copy)
    return sft_dir


def _sft_stages(r: TinyRecipe, out: Path, data: Path, stage, summary: dict[str, Any]) -> Path:
    """Tokenizer, expert data, base model and SFT; returns the SFT checkpoint."""
    from serve.chat_format import ChatFormat
    from train.expert_data import record

    data.mkdir(parents=True, exist_ok=True)
    data_key = {
        k: getattr(r, k) for k in ("families", "train_seeds", "sizes", "tokenizer_seeds", "vocab_size")
    }
    if r.train_seed_base:  # (absent when 0: data folders made before the option stay valid)
        data_key["train_seed_base"] = r.train_seed_base
    if r.vary_environment:  # (absent when off: data folders made before the option stay valid without it)
        data_key["vary_environment"] = True
    if r.expert_mistakes:  # (absent when 0: data folders made before the option stay valid)
        data_key["expert_mistakes"] = r.expert_mistakes
    if r.init:  # the expert data is tokenized with the init checkpoint's tokenizer
        data_key["init"] = str(Path(r.init).resolve())
    key_file = data / "data.json"
    if key_file.exists() and json.loads(key_file.read_text()) != json.loads(json.dumps(data_key)):
        raise ValueError(
            f"{data} was made for another task set or vocabulary ({key_file}); use another --data"
        )
    key_file.write_text(json.dumps(data_key, indent=2))

    tok_dir = data / "tokenizer"

    def make_tokenizer() -> None:
        if r.init:  # SFT samples must be token-exact for the init checkpoint: use its tokenizer
            tmp = tok_dir.with_name("tokenizer.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                shutil.copy(Path(r.init) / name, tmp / name)
            os.replace(tmp, tok_dir)
            return
        prov = provisional_tokenizer(data / "provisional-tokenizer")
        tasks = train_tasks(r, seeds=min(r.tokenizer_seeds, r.train_seeds))
        record(prov, tasks, data / "tokenizer-corpus", r.concurrency, r.vary_environment)
        texts = conversation_texts(data / "tokenizer-corpus" / "sessions", ChatFormat(prov))
        _save_tokenizer(train_bpe(texts, r.vocab_size), tok_dir.with_name("tokenizer.tmp"))
        os.replace(tok_dir.with_name("tokenizer.tmp"), tok_dir)

    stage("tokenizer", tok_dir / "tokenizer.json", make_tokenizer)

    expert_dir = data / "expert"

    def make_expert_data() -> None:
        tmp = data / "expert.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        passed = total = 0
        # The expert finds its plan by the task's prompt, and tasks of different seeds can share one
        # ("test_clamp fails. please fix"): record them in parts whose prompts are distinct.
        for i, part in enumerate(distinct_prompt_parts(train_tasks(r))):
            report = record(tok_dir, part, tmp / f"part-{i}", r.concurrency, r.vary_environment, r.expert_mistakes)
            passed += round(report["overall"].get("pass@1", 0) * len(part))
            total += len(part)
        if passed < total:
            raise RuntimeError(f"the scripted expert solved only {passed}/{total} training tasks")
        (tmp / "report.json").write_text(json.dumps({"episodes": total, "passed": passed}))
        if expert_dir.exists():
            shutil.rmtree(expert_dir)
        os.replace(tmp, expert_dir)

    stage("expert data", expert_dir / "report.json", make_expert_data)

    base = out / "base"
    if r.init:  # continue from a checkpoint (e.g. more SFT epochs on an earlier run's model)
        stage("base model", base / "model.safetensors", lambda: export_serving(Path(r.init), base))
    else:
        stage("base model", base / "model.safetensors", lambda: build_base(base, tok_dir, r))
    summary["params"] = n_params(base)
    chat = ChatFormat(base)
    lengths = [len(chat.encode(t)) for t in conversation_texts(expert_dir / "part-0" / "sessions", chat)[:60]]
    summary["expert_conversation_tokens_mean"] = round(sum(lengths) / max(1, len(lengths)), 1)
    say(
        f"model: {summary['params']:,} parameters; expert conversations ~{summary['expert_conversation_tokens_mean']} tokens"
    )

    sft_dir = out / "sft"
    stage("sft", sft_dir / "model.safetensors", lambda: sft(base, expert_dir, sft_dir, r))
    return sft_dir


def _eval_and_rl(r: TinyRecipe, out: Path, sft_dir: Path, stage, summary: dict[str, Any], timings) -> None:
    """Held-out eval of SFT, RL, held-out eval of RL, export; writes OUT/summary.json."""
    heldout = heldout_tasks(r)
    served = Served(out / "server.log", r.dtype)
    try:
        stage(
            "eval sft",
            out / "eval-sft" / "report.json",
            lambda: evaluate(served.serve(sft_dir), heldout, out / "eval-sft", r),
        )
        summary["sft"] = headline(json.loads((out / "eval-sft" / "report.json").read_text()))
        say(f"held-out after SFT: {summary['sft']}")
        if r.eval_t1:
            _eval_t1(served, sft_dir, heldout, out, "sft", r, stage, summary)

        final = sft_dir
        if not r.skip_rl:
            rl_dir = out / "rl"
            stage("rl", rl_dir / "final" / "model.safetensors", lambda: _rl(sft_dir, rl_dir, r, served))
            final = rl_dir / "final"
            stage(
                "eval rl",
                out / "eval-rl" / "report.json",
                lambda: evaluate(served.serve(final), heldout, out / "eval-rl", r),
            )
            summary["rl"] = headline(json.loads((out / "eval-rl" / "report.json").read_text()))
            say(f"held-out after RL: {summary['rl']}")
            if r.eval_t1:
                _eval_t1(served, final, heldout, out, "rl", r, stage, summary)
    finally:
        served.stop()

    export = out / "export"
    say(f"export: {final} -> {export}")  # always: a copy, and `final` changes when RL is added to a run
    export_serving(final, export)
    summary |= {"export": str(export), "timings_s": timings}
    old = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    summary["timings_s"] = old.get("timings_s", {}) | timings
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


def _eval_t1(
    served: Served, model: Path, heldout, out: Path, name: str, r: TinyRecipe, stage, summary
) -> None:
    """Held-out at T=1: the policy RL optimises (greedy can hide a change of the sampled policy)."""
    folder = out / f"eval-{name}-t1"
    stage(
        f"eval {name} T=1",
        folder / "report.json",
        lambda: evaluate(served.serve(model), heldout, folder, r, temperature=1.0),
    )
    summary[f"{name}_t1"] = headline(json.loads((folder / "report.json").read_text()))
    say(f"held-out after {name.upper()} at T=1: {summary[f'{name}_t1']}")


def _rl(sft_dir: Path, rl_dir: Path, r: TinyRecipe, served: Served) -> None:
    from train.algo import LossConfig
    from train.rl import RLConfig, latest_checkpoint
    from train.rl import run as rl_run
    from train.trainer import TrainerConfig

    cfg = RLConfig(
        steps=r.rl_steps,
        group_size=r.rl_group_size,
        groups_per_step=r.rl_groups_per_step,
        max_staleness=1,
        workers=r.rl_workers,
        seed=r.seed,
        save_every=max(1, min(r.rl_save_every, r.rl_steps)),
        temperature=1.0,
        max_output_tokens=r.max_output_tokens,
        vary_environment=r.vary_environment,
        shuffle_rewards=r.control == "shuffle",
    )
    tasks = _limit_turns(
        rl_tasks(r),
        r,
    )
    server = served.serve(sft_dir)
    resume = latest_checkpoint(rl_dir) is not None  # a killed run goes on from its last checkpoint
    if resume:
        say(f"rl: resuming from {latest_checkpoint(rl_dir)}")
    rl_run(
        sft_dir,
        tasks,
        rl_dir,
        cfg,
        trainer_cfg=TrainerConfig(lr=r.rl_lr, eps=r.rl_adam_eps, seed=r.seed, train_only=tuple(r.rl_train_only),
                                  dtype=served.dtype),  # what the recipe's server computes in
        loss=LossConfig(advantage=r.advantage, negative_weight=r.rl_negative_weight, kl_coef=r.rl_kl_coef),
        reward=reward_config(r),
        base_url=server.base_url,
        api_key=server.api_key,
        served_name=server.model,
        resume=resume,
    )
    last = max((rl_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    export_serving(last, rl_dir / "final")
    served.current = rl_dir / "final"  # RL's last weight sync loaded these very weights (same version)


def reward_config(r: TinyRecipe):
    """The default rewards (pass, length penalty, malformed calls); for the control every weight is 0, so
    every reward and hence every advantage is exactly 0 while everything else runs as in the real run."""
    from train.rewards import RewardConfig

    if r.control == "zero":
        return RewardConfig(pass_weight=0.0, length_coef=0.0, malformed_per_call=0.0, parallel_coef=0.0,
                            evidence_unsupported=0.0, evidence_contradicted=0.0)
    if r.control not in ("none", "shuffle"):
        raise ValueError(f"control must be none, zero or shuffle, got {r.control!r}")
    return RewardConfig.from_dict(r.reward)


def export_serving(src: Path, dst: Path) -> Path:
    """The serving folder without training state (what ships). It asks to be served in float64
    (`serve_dtype`, read by composer-serve's --dtype auto): a model this small meets greedy choices
    closer than float32 rounding, which differs between CPUs (vector width, library kernels, thread
    count); in float64 every machine picks the same token, so the demo and the published figures
    reproduce, and the model is small enough not to notice the cost."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in EXPORT_FILES:
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    policy = tmp / "composer_policy.json"
    if policy.exists():
        policy.write_text(json.dumps({**json.loads(policy.read_text()), "serve_dtype": "float64"}, indent=2))
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    return dst


def recipe_from_args(args) -> TinyRecipe:
    kw = {
        f.name: getattr(args, f.name) for f in fields(TinyRecipe) if getattr(args, f.name, None) is not None
    }
    for k in ("families", "sizes", "rl_sizes", "eval_sizes", "model_families", "rl_train_only"):
        if isinstance(kw.get(k), str):
            kw[k] = tuple(x for x in kw[k].split(",") if x)
    if isinstance(kw.get("reward"), list):  # --reward KEY=VALUE, repeated
        pairs = [x.partition("=") for x in kw["reward"]]
        bad = [k for k, eq, _ in pairs if not eq]
        if bad:
            raise ValueError(f"--reward takes KEY=VALUE (a RewardConfig field), got {bad}")
        kw["reward"] = {k: (v.lower() == "true" if v.lower() in ("true", "false") else float(v)) for k, _, v in pairs}
    if kw.get("rl_seeds") == 0:
        kw["rl_seeds"] = None  # RL on SFT's own seeds
    return TinyRecipe.smoke(**kw) if args.smoke else TinyRecipe(**kw)
