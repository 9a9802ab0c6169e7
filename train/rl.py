"""The RL run: rollouts through the real harness, group-relative advantages, a trainer step, weight
sync — asynchronously, with bounded staleness.

Batch k (the data of optimizer step k) is `groups_per_step` tasks x `group_size` episodes. A dispatcher
thread starts batch k's episodes once the server runs policy version >= k - max_staleness, so with
--max-staleness 0 rollouts wait for every new policy (synchronous) and with 1 the next batch is
sampled while the trainer trains on this one. At step s an episode is used only if
s - (the oldest policy version among its requests) <= max_staleness; older ones are dropped and
counted. Episodes that failed for infrastructure reasons are masked out and counted, never scored.

Tasks of batch k are a function of (seed, k) alone, so the data position is just the next step and a
resumed run sees the same task order. Everything a run writes is under --out: metrics.jsonl (one line
per step) and metrics.png, episodes.jsonl, trajectories/, policy/ (the weights being served) and
checkpoints/step-N (serving folder + optimizer/RNG state, what --resume restarts from).

With `colocate` (synchronous runs only) the engine runs in this process on the trainer's device
(train/colocate.py): its KV cache is freed for each trainer step and the new weights are copied into it in
memory; policy/ is not written.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agent.tasks import Task
from agent.tasks.eval import pass_at_k
from agent.tools import default_registry
from train.algo import LossConfig, group_advantages
from train.checkpoint import read_policy
from train.claim_credit import Decode, credit, normalizer_scale
from train.progress import Progress
from train.rewards import RewardConfig, compose
from train.rollout import Episode, RolloutConfig, describe
from train.rollouts import FirstGroups, Rollouts
from train.rollouts import RLConfig as RLConfig  # the run's config and its batches: train/rollouts.py
from train.server import Server, cpu_share, is_loopback, launch
from train.trainer import Trainer, TrainerConfig

if TYPE_CHECKING:
    from train.colocate import ColocateConfig


def advantages_for(episodes: list[Episode], version: int, cfg: RLConfig, loss: LossConfig,
                   reward: RewardConfig | None = None, decode: Decode | None = None
                   ) -> tuple[list, list[float], dict[str, Any]]:
    """(samples, advantage per sample, counts) after masking infra failures and episodes sampled more
    than cfg.max_staleness versions before `version`, the one this step trains.

    With `reward.evidence_on_claims` and a `decode` (token ids -> text), the evidence component is taken
    out of the episode's reward and credited to its false claims' tokens instead (train/claim_credit.py);
    not under cfg.shuffle_rewards, whose control shuffles whole rewards."""
    on_claims = bool(reward and reward.evidence_on_claims and decode is not None and not cfg.shuffle_rewards)
    counts: dict[str, Any] = {"infra_masked": 0, "dropped_stale": 0, "groups_skipped": 0}
    if on_claims:
        counts |= {"claim_credit_episodes": 0, "claim_credit_tokens": 0, "claim_credit_unlocated": 0,
                   "claim_credit_prob": None}
    logprob_sum = 0.0
    usable: list[Episode] = []
    for ep in episodes:
        if ep.infra_error or not ep.samples:
            counts["infra_masked"] += 1
        elif version - ep.min_version > cfg.max_staleness:
            counts["dropped_stale"] += 1
        else:
            usable.append(ep)
    def own(ep: Episode) -> float:  # the part of the reward the episode's group-relative advantage ranks
        return ep.reward - ep.components.get("evidence", 0.0) if on_claims else ep.reward

    reward_of = {id(ep): own(ep) for ep in usable}
    if cfg.shuffle_rewards:
        order = list(range(len(usable)))
        random.Random(f"shuffle-rewards/{cfg.seed}/{version}").shuffle(order)  # not the task order's stream
        reward_of = {id(ep): own(usable[j]) for ep, j in zip(usable, order, strict=True)}
    by_group: dict[int, list[Episode]] = {}
    for ep in usable:
        by_group.setdefault(ep.group, []).append(ep)
    samples, advs, unsplit = [], [], 0
    for group in by_group.values():
        if len(group) < 2:
            counts["groups_skipped"] += 1
            continue
        rewards = torch.tensor([reward_of[id(ep)] for ep in group], dtype=torch.float32)
        a = group_advantages(rewards, torch.zeros(len(group), dtype=torch.long), mode=loss.advantage,
                             std_normalize=loss.std_normalize)
        for ep, adv in zip(group, a.tolist(), strict=True):
            unsplit += len(ep.samples)
            penalty = ep.components.get("evidence", 0.0) if on_claims else 0.0
            clauses = ep.stats.false_claims if ep.stats else ()
            pairs, tokens, logprob = credit(ep.samples, adv, penalty, clauses, decode, reward.evidence_claim_weight
                                            ) if on_claims else ([(s, adv) for s in ep.samples], 0, 0.0)
            if penalty and clauses and on_claims:
                counts["claim_credit_episodes"] += 1
                counts["claim_credit_tokens"] += tokens
                counts["claim_credit_unlocated"] += not tokens
                logprob_sum += logprob
            for s, adv_s in pairs:
                samples.append(s)
                advs.append(adv_s)
    if on_claims and counts["claim_credit_tokens"]:  # the sampler's mean probability of a false claim's token
        counts["claim_credit_prob"] = round(math.exp(logprob_sum / counts["claim_credit_tokens"]), 4)
    if on_claims and len(samples) != unsplit:
        scale = normalizer_scale(unsplit, len(samples), loss.aggregation, loss.normalizer)
        advs = [x * scale for x in advs]
    return samples, advs, counts


def claim_decoder(model_dir: str | Path) -> Decode | None:
    """token ids -> text with the model's own tokenizer (special tokens kept, as the answer's span has
    them), for crediting claims to their tokens; None when the checkpoint has no tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


def latest_checkpoint(out: Path) -> Path | None:
    ckpts = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def serve_numerics(trainer: Trainer) -> list[str]:
    """composer-serve flags that compute what the trainer computes: its dtype, its batch-invariance."""
    return ["--dtype", str(trainer.dtype).removeprefix("torch.")] + (
        ["--batch-invariant"] if trainer.config.batch_invariant else [])


def run(model_dir: str | Path, tasks: list[Task], out: str | Path, cfg: RLConfig, *,
        trainer_cfg: TrainerConfig | None = None, loss: LossConfig | None = None,
        reward: RewardConfig | None = None, resume: bool = False, base_url: str | list[str] | None = None,
        api_key: str | None = None, served_name: str = "policy", progress: Progress | None = None,
        trainer: Trainer | None = None, colocate: ColocateConfig | None = None) -> list[dict]:
    """Run RL; returns the metrics of every step (also in OUT/metrics.jsonl)."""
    if colocate is not None and (cfg.max_staleness or base_url or cfg.overprovision or cfg.backend != "threads"):
        raise ValueError("colocated training is synchronous, on this machine: --max-staleness 0, no --base-url, "
                         "no --overprovision, the threads backend")
    heldout = [t.id for t in tasks if t.split == "heldout"]
    if heldout:
        raise ValueError(f"{len(heldout)} held-out tasks (e.g. {heldout[0]}) are in the training set: "
                         "held-out tasks are for evaluation only")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    loss = loss or LossConfig()
    if trainer is None:  # (train.distributed.fsdp passes its rank-0 leader of an FSDP2 trainer)
        trainer = Trainer(model_dir, trainer_cfg or TrainerConfig(seed=cfg.seed), loss)
    first = 0
    serve_from = Path(model_dir)
    ckpt = latest_checkpoint(out) if resume else None
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'}")
    if ckpt is not None:
        first = int(trainer.resume(ckpt)["next_batch"])
        serve_from = ckpt
        for name in ("metrics.jsonl", "episodes.jsonl"):  # steps after the checkpoint are redone
            _keep_before(out / name, first)
    else:
        for stale in ("metrics.jsonl", "episodes.jsonl"):
            (out / stale).unlink(missing_ok=True)
        if colocate is None and trainer.config.mxfp8_experts and read_policy(model_dir).get("experts") != "mxfp8":
            # Serve exactly what the trainer computes from step 0 on: the experts in MXFP8.
            serve_from = trainer.save(out / "policy" / f"v{trainer.policy_version}", resumable=False)
    urls = [base_url] if isinstance(base_url, str) else list(base_url or [])
    # async RL samples while it trains: on CPU, a sampler on this machine and the trainer take half the cores each
    share = cpu_share() if cfg.max_staleness > 0 and trainer.device.type == "cpu" else None
    colo = None
    if colocate is not None:  # the engine in this process, on the trainer's device, given its weights in memory
        from train.colocate import Colocated

        server = colo = Colocated(model_dir, trainer, colocate, name=served_name)
    elif len(urls) > 1:  # several inference servers: each episode sticks to one, every one gets the weights
        from train.distributed.pool import ServerPool

        server = ServerPool.from_urls(urls, served_name, api_key)
    else:
        server = (Server(urls[0], served_name, api_key) if urls
                  else launch(serve_from, *serve_numerics(trainer), *cfg.server_args, name=served_name,
                              log_path=out / "server.log",
                              threads=share))
    if base_url and server.version() != trainer.policy_version:
        server.load_weights(serve_from, trainer.policy_version)
    reward_cfg = reward or RewardConfig()
    decode = claim_decoder(model_dir) if reward_cfg.evidence_on_claims else None
    if decode is not None:
        normalizer_scale(1, 2, loss.aggregation, loss.normalizer)  # refuses 'seq_mean' now, not at step 1
    rollout = RolloutConfig(server.base_url, server.model, server.api_key, cfg.temperature, cfg.max_output_tokens,
                            vary_environment=cfg.vary_environment)
    spec_hash = default_registry().spec_hash()
    (out / "config.json").write_text(json.dumps({"rl": asdict(cfg), "trainer": asdict(trainer.config),
                                                 "loss": asdict(loss), "reward": asdict(reward or RewardConfig()),
                                                 "model": str(model_dir), "tasks": len(tasks)}, indent=2))
    if cfg.backend == "threads" and len(urls) <= 1:
        rollouts = (FirstGroups if cfg.overprovision else Rollouts)(tasks, cfg, rollout, compose(reward or RewardConfig()), out, first,
                            trainer.policy_version, spec_hash)
    else:
        from train.distributed.rollouts import DistributedRollouts

        rollouts = DistributedRollouts(tasks, cfg, rollout, reward or RewardConfig(), out, first,
                                       trainer.policy_version, spec_hash, endpoints=urls or None,
                                       backend="processes" if cfg.backend == "threads" else cfg.backend)
    progress = progress or Progress(cfg.steps, first)
    history: list[dict] = []
    threads = torch.get_num_threads()
    if share and all(is_loopback(u) for u in urls):
        torch.set_num_threads(share)
    try:
        for step in range(first, cfg.steps):
            t_wait = time.monotonic()
            episodes, rollout_s = rollouts.batch(step)
            wait_s = time.monotonic() - t_wait
            with open(out / "episodes.jsonl", "a") as f:
                for ep in episodes:
                    f.write(json.dumps({"step": step, **describe(ep)}) + "\n")
            # staleness in versions: they count on from the start checkpoint's own, one a step
            samples, advs, counts = advantages_for(episodes, trainer.policy_version, cfg, loss, reward_cfg, decode)
            m: dict[str, Any] = {"step": step, "policy_version": trainer.policy_version}
            m |= _episode_metrics(episodes, trainer.policy_version) | counts | getattr(rollouts, "last_counts", {})
            if samples:
                if colo is not None:
                    m |= colo.sleep()
                m |= trainer.step(samples, advs)
            else:  # nothing usable: keep versions moving so the staleness gate cannot deadlock
                trainer.policy_version += 1
                trainer.step_count += 1
            t_sync = time.monotonic()
            if colo is not None:
                handed = colo.hand_over()
                m |= {"hand_over_s": handed["hand_over_s"], "hand_over_bytes": handed["bytes"]} | colo.wake()
            else:
                policy_dir = out / "policy" / f"v{trainer.policy_version}"
                trainer.save(policy_dir, resumable=False)
                server.load_weights(policy_dir, trainer.policy_version)
                for old in (out / "policy").glob("v*"):
                    if old != policy_dir:
                        shutil.rmtree(old, ignore_errors=True)
            rollouts.set_version(trainer.policy_version)
            m |= {"sync_s": round(time.monotonic() - t_sync, 3), "wait_s": round(wait_s, 3),
                  "rollout_s": round(rollout_s, 3)}
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                trainer.save(out / "checkpoints" / f"step-{step + 1}", state={"next_batch": step + 1})
            history.append(m)
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(m) + "\n")
            progress.update(m)
    finally:
        torch.set_num_threads(threads)
        rollouts.close()
        progress.close()
        if not base_url:
            server.stop()
    from train.plot import plot_metrics

    plot_metrics(out / "metrics.jsonl", out / "metrics.png")
    return history


def _episode_metrics(episodes: list[Episode], version: int) -> dict[str, Any]:
    scored = [ep for ep in episodes if not ep.infra_error]
    n = max(1, len(scored))
    st = [e.stats for e in scored if e.stats]
    m = {"episodes": len(episodes), "reward_mean": round(sum(e.reward for e in scored) / n, 4),
         "pass_rate": round(sum(e.passed for e in scored) / n, 4),
         "completion_tokens": sum(e.completion_tokens for e in scored),
         "staleness_mean": round(sum(version - e.min_version for e in scored) / n, 3),
         "malformed_per_episode": round(sum(s.malformed_tool_calls for s in st) / n, 3),
         # evidence and efficiency, what the new reward terms push on (train/rewards.py)
         "claims_per_episode": round(sum(s.claims for s in st) / n, 3),
         "unsupported_per_episode": round(sum(s.unsupported_claims + s.contradicted_claims for s in st) / n, 3),
         "turns_mean": round(sum(s.turns for s in st) / n, 3),
         "tool_calls_mean": round(sum(s.tool_calls for s in st) / n, 3),
         "tool_calls_per_turn": round(sum(s.tool_calls_per_turn for s in st) / n, 3)}
    for name in sorted({k for e in scored for k in e.components}):
        m[f"reward_{name}"] = round(sum(e.components.get(name, 0.0) for e in scored) / n, 4)
    return m | best_of_k(scored)


def best_of_k(episodes: list[Episode]) -> dict[str, Any]:
    """pass@k (the unbiased estimator, k = 1, 2, 4, .. up to the smallest group) and best-of-K (the mean over
    groups of the group's best reward and whether any passed, K = the group's size) of a step's scored
    episodes: what sampling K times and keeping the best would get, which RL's pass@1 is chasing."""
    groups: dict[int, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.group, []).append(ep)
    if not groups:
        return {}
    smallest = min(len(g) for g in groups.values())
    out: dict[str, Any] = {}
    k = 1
    while k <= smallest:
        out[f"pass@{k}"] = round(sum(pass_at_k(len(g), sum(e.passed for e in g), k) for g in groups.values())
                                 / len(groups), 4)
        k *= 2
    out["best_of_k"] = smallest
    out["best_of_k_reward"] = round(sum(max(e.reward for e in g) for g in groups.values()) / len(groups), 4)
    out["best_of_k_pass"] = round(sum(any(e.passed for e in g) for g in groups.values()) / len(groups), 4)
    return out


def _keep_before(path: Path, step: int) -> None:
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < step]
        path.write_text("".join(r + "\n" for r in rows))
