"""The trainer: log-probs with the serving model's own code, the RL (or SFT) loss, AdamW.

The model is `serve.model.Qwen3MoeModel` loaded by the serving loader, run through `forward_train`
(no paged cache, causal attention over whole sequences) with the experts as trainable masters; by
default they go through the MXFP8 straight-through path, so the forward the trainer differentiates is
the forward the server runs on the saved checkpoint, and log-probs agree at equal weights. Each step
measures that agreement on the samples made by the current weights (`logprob_gap_max/mean`).

Gradient accumulation: a step's samples are cut into micro-batches of at most `micro_batch_tokens`
padded tokens; each micro-batch's loss is scaled so that the sum equals the loss of the whole batch.

Precision follows the server (`TrainerConfig.dtype`): AdamW keeps float32 masters, and the forward runs in
the dtype the checkpoint is served in, on copies of the masters in that dtype (exactly the values a saved
checkpoint serves: composer-serve rounds the same float32 to the same bfloat16), with the model's own
rounding points, not autocast's; MXFP8 experts are quantized from the float32 masters, as saved. With
`batch_invariant` the forward uses the server's batch-invariant numerics (serve/model/numerics.py), and its
log-probs equal those of a `composer-serve --batch-invariant` run in the same dtype bit for bit.

Limits: logits are materialised for a whole micro-batch ([B, L, V] float32): fine for small vocabularies,
chunk them before training a 150k-vocabulary model on long contexts.

KL penalty (LossConfig.kl_coef > 0): a frozen copy of the starting weights scores each micro-batch's
tokens (same experts replayed) as the reference. `train_only` freezes every parameter but the named ones.

Routing replay (`replay_routes`, on by default): tokens whose sample carries the server's experts
(train/samples.py) go to those experts, weighted by the trainer's own router probabilities of them, so
the router still gets gradients. Without it a near-tied router choice that rounds the other way here
(other kernels, another CPU) flips one token's experts and moves every later log-prob by ~1e-4; with
bf16 serving and weights a few steps stale, many more. Each step reports how many routes were replayed
and how many of those the trainer would have chosen differently (`routes_replayed`, `routes_differ`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from serve.cli import DTYPES
from serve.model.layers import RMSNorm
from serve.model.loader import load_model
from serve.model.qwen3_moe import in_dtype
from train.algo import LossConfig, policy_loss
from train.checkpoint import load_training, read_policy, save_policy
from train.samples import Sample


@dataclass
class TrainerConfig:
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon. Near the gradients' own scale (per-weight RMS), the step grows with the gradient
    instead of being ~lr for every weight, so weights the batch says little about move little."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    micro_batch_tokens: int = 8192
    """Padded tokens (sequences x longest) per forward pass; a step accumulates gradients over them."""
    load_format: str = "auto"
    """"dummy": random weights made on the device from config.json alone (serve/model/dummy.py, as vLLM's
    --load-format dummy): to measure speed and memory at a real model's shape without its checkpoint."""
    activation_checkpointing: bool = False
    """Keep only each layer's input for the backward and run the layer again there (torch.utils.checkpoint):
    activations of one layer at a time instead of all of them, for about a third more compute."""
    vocab_chunk: int = 16384
    """The LM head and log-softmax run this many vocabulary rows at a time when the vocabulary is larger
    (kernels/lm_head.py): memory O(tokens x chunk), never [tokens, V] (Qwen3's V is 151,936). Smaller
    vocabularies, and batch-invariant numerics, take the whole row at once, as the server does."""
    mxfp8_experts: bool = True
    """Experts forward through MXFP8 (as served) and are saved in MXFP8."""
    expert_backward: str = "grouped"
    """The experts' backward (kernels/moe_grouped.py BACKWARDS): "grouped" (six grouped GEMMs, the SwiGLU
    backward in torch ops), or "fused" (five, with the SwiGLU backward, the router weight and its gradient
    in one kernel: kernels/swiglu_triton.py; the same gradients up to rounding). A process setting: the
    last Trainer built sets it."""
    fused_norms: bool = False
    """The RMSNorms (input, post-attention, q and k heads, final) forward and backward as one Triton launch each
    (kernels/rms_norm_triton.py: ~23 torch kernels per norm -> 3) where Triton runs (a GPU, or the
    interpreter); elsewhere, and in batch-invariant numerics, the model's own ops. Same rounding points; the
    mean's summation order differs."""
    fused_lm_head: bool = False
    """The sliced LM head (vocabularies over vocab_chunk) with each slice's softmax work in one Triton launch
    each way (kernels/lm_head_triton.py: ~20 float32 passes over [tokens, chunk] per slice -> 1) where Triton
    runs; the matmuls stay cuBLAS's. Same log-probs to float32 rounding."""
    device: str | None = None
    """cpu or cuda (default: cuda when available)."""
    seed: int = 0
    """Seeds torch's RNG at start-up."""
    replay_routes: bool = True
    """Route each token to the experts the server used for it, where the sample says (routing replay)."""
    dtype: str | None = None
    """What the forward computes in: bfloat16, float16, float32 or float64. Default: what the checkpoint is
    served in (`serve_dtype` in composer_policy.json), else as composer-serve's --dtype auto (bfloat16 on a
    GPU, float32 on a CPU). Masters and AdamW state are float32 (float64 for a float64 forward)."""
    batch_invariant: bool | str = False
    """Score with batch-invariant numerics (serve/model/numerics.py), as `composer-serve --batch-invariant`:
    True picks the device's mode as the server does ("fixed" kernels on a GPU, "float64" on a CPU), or name one."""
    train_only: tuple[str, ...] = ()
    """Regular expressions of parameter names (`re.search`); when given, every other parameter is frozen.
    RL learns a few bits per episode (one reward), which few parameters can hold; Adam moves every
    trained weight by about the learning rate each step, signal or not, so fewer trained weights is
    less noise for the same signal (e.g. ("norm",): the RMSNorm gains only)."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.micro_batch_tokens < 1 or self.vocab_chunk < 1 or self.grad_clip < 0 \
                or not self.eps > 0:
            raise ValueError("lr, eps, micro_batch_tokens and vocab_chunk must be positive and grad_clip >= 0")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, not {self.load_format!r}")
        if self.dtype not in (None, *DTYPES):
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        from kernels.moe_grouped import BACKWARDS

        if self.expert_backward not in BACKWARDS:
            raise ValueError(f"expert_backward must be one of {', '.join(BACKWARDS)}, not {self.expert_backward!r}")



class TrainingRMSNorm(RMSNorm):
    """The model's RMSNorm whose differentiated forward runs kernels/rms_norm_triton.py (TrainerConfig.fused_norms)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.backend import use_triton

        if (not self.exact and torch.is_grad_enabled() and x.dtype == self.weight.dtype
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and use_triton(x.device)):
            from kernels.rms_norm_triton import rms_norm_train

            return rms_norm_train(x, self.weight, self.eps)
        return super().forward(x)


def _fused_target_logprobs(m, ids_BL: torch.Tensor, sel_BT: torch.Tensor, chunk: int,
                           routes_BLMK: torch.Tensor | None) -> torch.Tensor:
    """Qwen3MoeModel.target_logprobs with the LM head's slices through kernels/lm_head_triton.py."""
    from kernels.lm_head_triton import fused_chunked_logprobs

    h_ND = m.hidden_train(ids_BL, routes_BLMK)[:, :-1][sel_BT]
    w_VD = m.lm_head.weight if m.lm_head is not None else m.embed_tokens.weight
    return fused_chunked_logprobs(h_ND, w_VD, ids_BL[:, 1:][sel_BT], chunk)


def compute_dtype(model_dir: str | Path, dtype: str | None, device: torch.device) -> torch.dtype:
    """TrainerConfig.dtype resolved: as given, else the checkpoint's serve_dtype, else as composer-serve's auto."""
    from serve.engine.hf import resolve_dtype
    from serve.engine.weights import read_serve_dtype

    return resolve_dtype(dtype or read_serve_dtype(model_dir, DTYPES) or "auto", device.type)


def micro_batches(samples: list[Sample], budget: int) -> list[list[int]]:
    """Indices of samples grouped so that len(group) x longest <= budget (at least one each)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    return groups


def pad(samples: list[Sample], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, L], mask [B, L], sampler logprobs [B, L], right-padded with zeros."""
    L = max(len(s.token_ids) for s in samples)
    ids = torch.zeros(len(samples), L, dtype=torch.long)
    mask = torch.zeros(len(samples), L)
    slp = torch.zeros(len(samples), L)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids)
        mask[i, :n] = torch.tensor(s.mask, dtype=torch.float32)
        slp[i, :n] = torch.tensor(s.sampler_logprobs, dtype=torch.float32)
    return ids.to(device), mask.to(device), slp.to(device)


def pad_routes(samples: list[Sample], device: torch.device) -> torch.Tensor | None:
    """The samples' routed experts [B, L, M, K], -1 where none were recorded; None if no sample has any."""
    shapes = {s.routes.shape[1:] for s in samples if s.routes is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"samples with routed experts of different shapes: {sorted(shapes)}")
    L = max(len(s.token_ids) for s in samples)
    out = torch.full((len(samples), L, *shapes.pop()), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        if s.routes is not None:
            n = min(len(s.routes), len(s.token_ids))
            out[i, :n] = torch.from_numpy(s.routes[:n])
    return out.to(device)


class Trainer:
    def __init__(self, model_dir: str | Path, config: TrainerConfig | None = None,
                 loss: LossConfig | None = None):
        self.config = c = config or TrainerConfig()
        self.loss = loss or LossConfig()
        self.base_dir = Path(model_dir)
        self.device = torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.manual_seed(c.seed)
        self.dtype = compute_dtype(model_dir, c.dtype, self.device)
        from train.memory_plan import plan_for

        world = getattr(self, "world", None)  # FSDPTrainer sets it (and its device) before calling this
        self.memory_plan = plan_for(model_dir, c, compute_bytes=self.dtype.itemsize, world=world or 1,
                                    fsdp=world is not None,
                                    device=getattr(self, "plan_device", self.device.type))
        master = torch.float64 if self.dtype == torch.float64 else torch.float32
        if c.load_format == "dummy":
            from serve.model.dummy import random_model

            self.model = random_model(model_dir, device=self.device, dtype=master, seed=c.seed)
        else:
            self.model = load_model(model_dir, device=self.device, dtype=master, quant="none")
        self.model.to_training(c.mxfp8_experts)
        from kernels import moe_grouped

        moe_grouped.BACKWARD[0] = c.expert_backward
        if c.fused_norms:
            for m in self.model.modules():
                if type(m) is RMSNorm:
                    m.__class__ = TrainingRMSNorm  # the same module, parameters and all, with the fused kernels
        self.model.set_batch_invariant(c.batch_invariant)
        self.model.activation_checkpointing = c.activation_checkpointing
        if c.train_only:
            for name, p in self.model.named_parameters():
                p.requires_grad_(any(re.search(pat, name) for pat in c.train_only))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"train_only {c.train_only} matches no parameter of the model")
        self.ref_model = None
        if self.loss.kl_coef > 0:  # the frozen reference for the KL penalty: the weights training starts from
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)
        # on a GPU one fused kernel per parameter group (no per-tensor launches); elsewhere the foreach path
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.params, lr=c.lr, betas=c.betas, eps=c.eps,
                                           weight_decay=c.weight_decay, foreach=not fused, fused=fused or None)
        self.policy_version = int(read_policy(model_dir).get("policy_version", 0))
        self.step_count = 0

    # -- forward ---------------------------------------------------------------------------------------

    score_trained_only = True  # run the LM head on trained positions only (see _token_logprobs)
    phase_times: dict[str, float] | None = None  # set to {} to have step() add seconds per phase (syncs a GPU)

    @contextlib.contextmanager
    def _phase(self, name: str):
        if self.phase_times is None:
            yield
            return
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.phase_times[name] = self.phase_times.get(name, 0.0) + time.perf_counter() - t0

    def _token_logprobs(self, ids_BL: torch.Tensor, mask_BL: torch.Tensor | None = None,
                        routes_BLMK: torch.Tensor | None = None,
                        model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-prob of each token given the ones before it: [B, L-1] (position t scores token t+1).
        With `mask_BL`, only tokens where it is set are scored (0 elsewhere): the LM head and the
        softmax over the vocabulary then run on those positions alone, which is most of the cost of a
        small model whose trained (sampled) tokens are a fraction of each sequence. `routes_BLMK`: the
        experts to replay (pad_routes). `model`: another model of the same shape (the KL reference)."""
        m = self.model if model is None else model
        if not self.config.replay_routes:
            routes_BLMK = None
        chunk = self.config.vocab_chunk
        if m.cfg.vocab_size > chunk and not m.batch_invariant:  # never [tokens, V] at once
            sel_BT = mask_BL[:, 1:] > 0 if mask_BL is not None else torch.ones_like(ids_BL[:, 1:], dtype=torch.bool)
            if self._fused_lm_head():
                lp_N = self._in_compute_dtype(m, lambda mm: _fused_target_logprobs(mm, ids_BL, sel_BT, chunk, routes_BLMK))
            else:
                lp_N = self._in_compute_dtype(m, lambda mm: mm.target_logprobs(ids_BL, sel_BT, chunk, routes_BLMK))
            return torch.zeros(sel_BT.shape, dtype=lp_N.dtype, device=lp_N.device).masked_scatter(sel_BT, lp_N)
        if mask_BL is None:
            logits_BLV = self._in_compute_dtype(m, lambda mm: mm.forward_train(ids_BL, routes_BLMK))
            logp_BTV = F.log_softmax(logits_BLV[:, :-1].float(), dim=-1)
            return logp_BTV.gather(-1, ids_BL[:, 1:, None]).squeeze(-1)
        sel_BT = mask_BL[:, 1:] > 0
        logits_NV = self._in_compute_dtype(
            m, lambda mm: mm.logits(mm.hidden_train(ids_BL, routes_BLMK)[:, :-1][sel_BT]))
        logp_NV = F.log_softmax(logits_NV.float(), dim=-1)
        lp_N = logp_NV.gather(-1, ids_BL[:, 1:][sel_BT][:, None]).squeeze(-1)
        return torch.zeros(sel_BT.shape, dtype=lp_N.dtype, device=lp_N.device).masked_scatter(sel_BT, lp_N)

    def _fused_lm_head(self) -> bool:
        from kernels.backend import use_triton

        return (self.config.fused_lm_head and self.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and use_triton(self.device))

    cast_weights = True  # copies of the masters in the compute dtype for each forward (FSDP: its own policy)

    def _in_compute_dtype(self, m: torch.nn.Module, fn):
        """fn(m) on copies of m's masters in the compute dtype (serve/model/qwen3_moe.in_dtype)."""
        if not self.cast_weights or m.embed_tokens.weight.dtype == self.dtype:
            return fn(m)
        return in_dtype(m, self.dtype, fn)

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per sample: the trainer's log-prob of tokens 1..n-1 (aligned with token_ids[1:])."""
        out: list[torch.Tensor | None] = [None] * len(samples)
        for group in micro_batches(samples, self.config.micro_batch_tokens):
            mb = [samples[i] for i in group]
            ids, _, _ = pad(mb, self.device)
            lp = self._token_logprobs(ids, routes_BLMK=pad_routes(mb, self.device)).cpu()
            for row, i in enumerate(group):
                out[i] = lp[row, : len(samples[i].token_ids) - 1]
        return out  # type: ignore[return-value]

    # -- one optimizer step ----------------------------------------------------------------------------

    def step(self, samples: list[Sample], advantages: list[float], sft: bool = False) -> dict[str, Any]:
        """One optimizer step on `samples` (advantage per sample); with `sft`, maximise the
        likelihood of the masked tokens instead. Returns metrics, including the sampler/trainer
        log-prob gap on samples made by the current weights."""
        if not samples:
            raise ValueError("a step needs at least one sample")
        t0 = time.monotonic()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(sum(s.mask[1:]) for s in samples) or 1
        n_seqs = len(samples)
        gaps: list[torch.Tensor] = []
        stale_gaps: list[torch.Tensor] = []
        sums: dict[str, float] = {}
        loss_total = 0.0
        moes = self.model.moe_layers()
        for moe in moes:
            moe.replay_counts = None
        for group in micro_batches(samples, self.config.micro_batch_tokens):
            mb = [samples[i] for i in group]
            loss, diff, mask_BT = self._micro_step(mb, [advantages[i] for i in group] if not sft else None,
                                                   total_tokens, n_seqs, sums)
            loss_total += loss
            for row, s in enumerate(mb):
                d = diff[row][mask_BT[row] > 0]
                (gaps if s.min_version == self.policy_version and max(s.versions) == self.policy_version
                 else stale_gaps).append(d)
        c = self.config
        with self._phase("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, c.grad_clip if c.grad_clip > 0 else math.inf)
            self.optimizer.step()
        self.step_count += 1
        self.policy_version += 1
        out = {"loss": loss_total, "grad_norm": float(grad_norm), "samples": n_seqs, "train_tokens": total_tokens,
               "train_s": round(time.monotonic() - t0, 4)}
        out |= {f"loss_{k}": v for k, v in sums.items()}
        fresh = torch.cat(gaps) if gaps else torch.empty(0)
        stale = torch.cat(stale_gaps) if stale_gaps else torch.empty(0)
        if fresh.numel():
            out |= {"logprob_gap_max": float(fresh.max()), "logprob_gap_mean": float(fresh.mean())}
        if stale.numel():
            out |= {"stale_logprob_gap_mean": float(stale.mean())}
        counts = [m.replay_counts for m in moes if m.replay_counts is not None]
        if counts:  # per (token, MoE layer): replayed, and of those routed otherwise by this trainer
            replayed, differ = (int(x) for x in torch.stack(counts).sum(0))
            out |= {"routes_replayed": replayed, "routes_differ": differ}
        return out

    def _micro_step(self, mb: list[Sample], advantages: list[float] | None, total_tokens: int, n_seqs: int,
                    sums: dict[str, float]) -> tuple[float, torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch (SFT when `advantages` is None), its loss weighted so
        that the micro-batches sum to the batch's loss; adds its loss terms into `sums`. Returns the
        loss, |trainer - sampler| log-prob per token [B, T] and the trained-token mask [B, T]."""
        with self._phase("forward"):
            loss, metrics, logp_BT, mask_BT, slp_BT = self._forward_loss(mb, advantages, total_tokens, n_seqs)
        with self._phase("backward"):
            loss.backward()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v) * len(mb) / n_seqs
        return float(loss.detach()), (logp_BT.detach() - slp_BT).abs(), mask_BT

    def _forward_loss(self, mb: list[Sample], advantages: list[float] | None, total_tokens: int, n_seqs: int):
        ids, mask, slp = pad(mb, self.device)
        scored, routes = mask if self.score_trained_only else None, pad_routes(mb, self.device)
        logp_BT = self._token_logprobs(ids, scored, routes)
        mask_BT, slp_BT = mask[:, 1:], slp[:, 1:]
        if advantages is None:
            loss = -(logp_BT * mask_BT).sum() / total_tokens
            metrics: dict[str, Any] = {}
        else:
            adv_B = torch.tensor(advantages, dtype=torch.float32, device=self.device)
            ref_BT = None
            if self.ref_model is not None:  # the same tokens, experts and trained positions, frozen weights
                with torch.no_grad():
                    ref_BT = self._token_logprobs(ids, scored, routes, model=self.ref_model)
            loss, metrics = policy_loss(logp_BT, slp_BT, adv_B, mask_BT, self._loss_config(n_seqs),
                                        ref_logprobs_BT=ref_BT)
            loss = loss * self._scale(mask_BT, len(mb), total_tokens, n_seqs)
        return loss, metrics, logp_BT, mask_BT, slp_BT

    def _loss_config(self, n_seqs: int) -> LossConfig:
        if self.loss.aggregation == "token_sum" and self.loss.normalizer is None:
            return replace(self.loss, normalizer=float(n_seqs * 1024))
        return self.loss

    def _scale(self, mask_BT: torch.Tensor, n_mb: int, total_tokens: int, n_seqs: int) -> float:
        """Weight of one micro-batch so that the micro-batch losses sum to the whole batch's loss."""
        agg = self.loss.aggregation
        if agg == "token_mean":
            return float(mask_BT.sum()) / total_tokens
        if agg == "seq_mean":
            return n_mb / n_seqs
        return 1.0  # token_sum: a constant normaliser already

    # -- checkpoints -----------------------------------------------------------------------------------

    def save(self, out_dir: str | Path, *, state: dict[str, Any] | None = None, resumable: bool = True) -> Path:
        """The serving folder for the current weights (policy version included), and with
        `resumable` the optimizer, masters, RNG and `state` (the caller's data position)."""
        training = {"optimizer": self.optimizer,
                    "state": {"step": self.step_count, "policy_version": self.policy_version, **(state or {})}}
        return save_policy(self.model, self.base_dir, out_dir, policy_version=self.policy_version,
                           step=self.step_count, mxfp8_experts=self.config.mxfp8_experts,
                           training=training if resumable else None)

    def resume(self, ckpt_dir: str | Path) -> dict[str, Any]:
        state = load_training(ckpt_dir, self.model, self.optimizer)
        self.step_count, self.policy_version = int(state["step"]), int(state["policy_version"])
        return state

