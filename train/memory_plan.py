"""What one training step needs in memory per GPU (or per CPU process), before it starts.

    plan = memory_plan(cfg, world=8, fsdp=True, compute_bytes=2, micro_batch_tokens=4096,
                       activation_checkpointing=True)
    print(plan.table()); plan.check(capacity_bytes)   # raises PlanDoesNotFit with the table

The terms, per rank (W ranks with FSDP2, which shards every parameter, experts included, by its first
dimension, and AdamW's moments with them; one rank without):

- masters, gradients, AdamW moments: 4 + 4 + 8 bytes per parameter (float32; float64 masters double it) / W
- compute copies: without FSDP, the forward's copies of the non-expert weights in the compute dtype (none
  when it is the masters' dtype); with FSDP, two layers gathered at a time (the current one and the one
  prefetched) plus the root's embeddings and LM head, held through the forward
- MXFP8 experts: the quantized copy the forward computes with, 1 + 1/32 bytes per expert weight: without
  FSDP every MoE layer's (the cache that lasts the optimizer step, which the backward reads too); with
  FSDP one layer's (the gathered weights are quantized again in each layer's backward)
- activations saved for the backward, per token per layer (the tensors this code saves, counted in
  `activation_bytes_per_token`), every layer's, or with activation checkpointing each layer's input plus
  one layer's
- the expert backward's working set for one layer: its dequantized weights and their gradients in the
  compute dtype, and the gradients cast to the masters' dtype
- the LM head and loss: the sliced log-softmax (kernels/lm_head.py) holds tokens x vocab_chunk float32
  logits, probabilities and their gradient; unsliced (small vocabularies), tokens x vocabulary
- allocator reserve: 10% on top (fragmentation, workspaces, the CUDA context)

Resident rows (masters, AdamW moments, the MXFP8 cache of one process) last between steps; the others
are what a step adds. The total adds them all, an upper bound: the activations are freed as the gradients
fill in. tests/train/test_memory_plan.py checks the step's part against peaks measured on a CPU (one
process, and FSDP on two gloo ranks, at a reduced shape): measured within 55-100% of planned.

`colocated_plan` adds an inference engine on the same device (train/colocate.py): its weights always, its
KV cache during rollouts only (released while the trainer steps, as verl's hybrid engine does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve.model.config import ModelConfig

GIB = 2**30
RESERVE = 0.10


class PlanDoesNotFit(ValueError):
    """The planned step needs more memory than the device has (`plan`, and `advice`: what to change)."""

    def __init__(self, plan: MemoryPlan, advice: str):
        super().__init__(f"{plan.table()}\n{advice}")
        self.plan, self.advice = plan, advice


@dataclass
class MemoryPlan:
    rows: list[tuple[str, float]] = field(default_factory=list)
    resident: set[str] = field(default_factory=set)  # rows that outlast a step
    world: int = 1
    fsdp: bool = False
    capacity: float | None = None

    @property
    def subtotal(self) -> float:
        return sum(b for _, b in self.rows)

    @property
    def step_bytes(self) -> float:
        """What one step adds on top of the resident rows (no reserve)."""
        return sum(b for name, b in self.rows if name not in self.resident)

    @property
    def total(self) -> float:
        return self.subtotal * (1 + RESERVE)

    def as_dict(self) -> dict:
        return {"per_rank_bytes": round(self.total), "rows": {k: round(v) for k, v in self.rows},
                "world": self.world, "fsdp": self.fsdp, "capacity_bytes": self.capacity}

    def table(self) -> str:
        where = f"FSDP over {self.world} ranks" if self.fsdp else "one process"
        lines = [f"memory plan per rank ({where}):"]
        lines += [f"  {name:<38} {b / GIB:9.2f} GiB" for name, b in self.rows]
        lines.append(f"  {'allocator reserve (10%)':<38} {self.subtotal * RESERVE / GIB:9.2f} GiB")
        cap = f" of {self.capacity / GIB:.1f} GiB" if self.capacity else ""
        lines.append(f"  {'total':<38} {self.total / GIB:9.2f} GiB{cap}")
        return "\n".join(lines)

    def check(self, capacity: float | None) -> None:
        self.capacity = capacity
        if capacity is not None and self.total > capacity:
            hint = ("more ranks (--fsdp under torchrun)" if not self.fsdp else "more ranks") + \
                   ", --activation-checkpointing, or a smaller --micro-batch-tokens"
            raise PlanDoesNotFit(self, f"the step needs {self.total / GIB:.1f} GiB per rank but "
                                       f"{capacity / GIB:.1f} GiB are there: use {hint}")


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """total, experts (all MoE layers), expert_layer (one MoE layer's experts), layer (largest layer,
    experts included), root (embeddings, LM head, final norm)."""
    D, H, G, C = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn = D * H * C + 2 * D * G * C + H * C * D + 2 * C + 2 * D
    expert_layer = cfg.num_experts * 3 * D * cfg.moe_intermediate_size
    moe_layer = attn + cfg.num_experts * D + expert_layer
    dense_layer = attn + 3 * D * cfg.intermediate_size
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    dense_layers = cfg.num_hidden_layers - moe_layers
    root = cfg.vocab_size * D * (1 if cfg.tie_word_embeddings else 2) + D
    return {"total": root + moe_layers * moe_layer + dense_layers * dense_layer,
            "experts": moe_layers * expert_layer, "expert_layer": expert_layer,
            "layer": max(moe_layer if moe_layers else 0, dense_layer if dense_layers else 0), "root": root}


def activation_bytes_per_token(cfg: ModelConfig, compute_bytes: int, on_gpu: bool) -> float:
    """Bytes one token leaves saved for the backward in one MoE layer (this code's forward_dense)."""
    D, H, G, C = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, K, c = cfg.num_experts, cfg.num_experts_per_tok, compute_bytes
    norms = 2 * (4 * D + 4 + 2 * c * D)  # two RMSNorms: float32 input, rstd, output and the matmul's input
    qk_norms = H * C * (4 + c) + 4 * H + G * C * (4 + c) + 4 * G
    kv = 2 * G * C if on_gpu else 2 * H * C  # the CPU flash kernel takes K/V repeated to every query head
    attention = c * (H * C + kv + H * C) + 4 * H  # q, k, v, output, log-sum-exp
    router = 4 * E + 8 * K + 4 + 4 * K + c * K
    return norms + qk_norms + attention + router


def memory_plan(cfg: ModelConfig, *, world: int = 1, fsdp: bool = False, compute_bytes: int = 2,
                master_bytes: int = 4, micro_batch_tokens: int = 8192, activation_checkpointing: bool = False,
                vocab_chunk: int = 16384, mxfp8_experts: bool = True, on_gpu: bool = True,
                scored_tokens: int | None = None) -> MemoryPlan:
    """The per-rank memory of one step (see the module docstring). `micro_batch_tokens`: padded tokens
    per forward; `scored_tokens`: of those, the trained ones the LM head runs on (default: all, the
    worst case)."""
    if fsdp and world < 1:
        raise ValueError("world must be at least 1")
    n = parameter_counts(cfg)
    shards = world if fsdp else 1
    layers = cfg.num_hidden_layers
    moe_layers = sum(1 for i in range(layers) if cfg.is_moe_layer(i))
    c, m, T = compute_bytes, master_bytes, micro_batch_tokens
    plan = MemoryPlan(world=world, fsdp=fsdp)
    plan.rows.append(("master weights", n["total"] * m / shards))
    plan.rows.append(("gradients", n["total"] * m / shards))
    plan.rows.append(("AdamW moments", 2 * n["total"] * m / shards))
    plan.resident |= {"master weights", "AdamW moments"}
    if fsdp:
        plan.rows.append(("gathered weights (2 layers + root)", (2 * n["layer"] + n["root"]) * c))
    elif c != m:
        plan.rows.append(("compute-dtype copies", (n["total"] - (n["experts"] if mxfp8_experts else 0)) * c))
    if mxfp8_experts and moe_layers:
        held = 1 if fsdp else moe_layers  # under FSDP: quantized again in each layer's backward
        name = f"MXFP8 experts ({held} layer{'s' if held > 1 else ''})"
        plan.rows.append((name, held * n["expert_layer"] * (1 + 1 / 32)))
        if not fsdp:  # the cache that lasts the optimizer step
            plan.resident.add(name)
    per_layer = activation_bytes_per_token(cfg, c, on_gpu) * T
    if activation_checkpointing:
        plan.rows.append(("activations (layer inputs + 1 layer)", layers * T * cfg.hidden_size * c + per_layer))
    else:
        plan.rows.append((f"activations ({layers} layers)", layers * per_layer))
    if moe_layers:
        plan.rows.append(("expert backward (1 layer)", n["expert_layer"] * (2 * c + m)))
    V = cfg.vocab_size
    width = vocab_chunk if V > vocab_chunk else V
    N = T if scored_tokens is None else min(scored_tokens, T)
    # float32 logits, their exponentials and the gradient's slice (plus the matmul's own output when the
    # compute dtype is not float32), and the hidden rows with their gradient
    per_logit = 3 * 4 + (c if c != 4 else 0)
    plan.rows.append(("LM head and loss", N * width * per_logit + N * cfg.hidden_size * (4 + 2 * c)))
    return plan


@dataclass
class ColocatedPlan:
    """Trainer and inference engine in one process on one device (train/colocate.py), in two phases:
    the trainer's step (its plan, plus the engine's weights, which stay; the KV cache is released unless
    `release_kv` is off) and the rollouts (the trainer's resident rows, its gradients dropped at the
    hand-over, plus the engine's weights, KV cache and step reserve). Each phase gets the 10% reserve; the
    device must hold the larger."""

    train: MemoryPlan
    rollout: list[tuple[str, float]]
    kv_tokens: int
    kv_bytes_per_token: int
    release_kv: bool = True
    capacity: float | None = None

    @property
    def rollout_total(self) -> float:
        return sum(b for _, b in self.rollout) * (1 + RESERVE)

    @property
    def total(self) -> float:
        return max(self.train.total, self.rollout_total)

    def as_dict(self) -> dict:
        return {"per_rank_bytes": round(self.total), "train_bytes": round(self.train.total),
                "rollout_bytes": round(self.rollout_total), "kv_tokens": self.kv_tokens,
                "train_rows": {k: round(v) for k, v in self.train.rows},
                "rollout_rows": {k: round(v) for k, v in self.rollout}, "release_kv": self.release_kv,
                "capacity_bytes": self.capacity}

    def table(self) -> str:
        lines = ["colocated memory plan (trainer and engine on one device):", "  trainer's step"
                 + (" (KV cache released):" if self.release_kv else ":")]
        lines += ["  " + line for line in self.train.table().splitlines()[1:]]
        lines.append("  rollouts:")
        lines += [f"    {name:<38} {b / GIB:9.2f} GiB" for name, b in self.rollout]
        lines.append(f"    {'allocator reserve (10%)':<38} {self.rollout_total * RESERVE / (1 + RESERVE) / GIB:9.2f} GiB")
        cap = f" of {self.capacity / GIB:.1f} GiB" if self.capacity else ""
        lines.append(f"    {'total':<38} {self.rollout_total / GIB:9.2f} GiB{cap}")
        return "\n".join(lines)

    def check(self, capacity: float | None) -> None:
        self.capacity = capacity
        if capacity is not None and self.total > capacity:
            raise PlanDoesNotFit(self, f"trainer and engine need {self.total / GIB:.1f} GiB together but "
                                       f"{capacity / GIB:.1f} GiB are there: use a smaller --kv-cache-tokens, "
                                       "--activation-checkpointing or a smaller --micro-batch-tokens")


def engine_weight_bytes(cfg: ModelConfig, serve_bytes: int, mxfp8_experts: bool) -> float:
    """The inference engine's weights: dense ones in the serving dtype, experts in MXFP8 (1 + 1/32 bytes)
    or the serving dtype."""
    n = parameter_counts(cfg)
    return (n["total"] - n["experts"]) * serve_bytes + n["experts"] * ((1 + 1 / 32) if mxfp8_experts else serve_bytes)


def colocated_plan(train: MemoryPlan, cfg: ModelConfig, *, serve_bytes: int, mxfp8_experts: bool,
                   engine_reserve: float, kv_tokens: int | None = None, release_kv: bool = True,
                   capacity: float | None = None) -> ColocatedPlan:
    """`train` (memory_plan's step) with an engine beside it. `kv_tokens` None: what the rollout phase leaves
    of `capacity` (raises PlanDoesNotFit when that is not one block of 16 tokens)."""
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * serve_bytes
    weights = ("engine weights" + (" (MXFP8 experts)" if mxfp8_experts else ""),
               engine_weight_bytes(cfg, serve_bytes, mxfp8_experts))
    resident = [(k, v) for k, v in train.rows if k in train.resident]
    fixed = sum(b for _, b in resident) + weights[1] + engine_reserve
    if kv_tokens is None:
        if capacity is None:
            raise ValueError("kv_tokens or capacity is needed")
        kv_tokens = int((capacity / (1 + RESERVE) - fixed) // per_token)
        if not release_kv:  # it stays through the trainer's step too
            kv_tokens = min(kv_tokens, int((capacity / (1 + RESERVE) - train.subtotal - weights[1]) // per_token))
    plan = MemoryPlan(rows=list(train.rows) + [weights], resident=set(train.resident) | {weights[0]},
                      world=train.world, fsdp=train.fsdp)
    kv = (f"engine KV cache ({max(kv_tokens, 0)} tokens)", float(max(kv_tokens, 0) * per_token))
    if not release_kv:
        plan.rows.append(kv)
        plan.resident.add(kv[0])
    rollout = resident + [weights, kv, ("engine step reserve", float(engine_reserve))]
    out = ColocatedPlan(plan, rollout, kv_tokens, per_token, release_kv, capacity)
    if kv_tokens < 16:
        raise PlanDoesNotFit(out, "the trainer's resident state and the engine's weights leave no room for a KV "
                                  "cache on this device")
    return out


def capacity_bytes(device: str) -> float:
    """What a rank has: the GPU's memory, or on a CPU the machine's."""
    import os

    import torch

    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def plan_for(model_dir, config, *, compute_bytes: int, world: int = 1, fsdp: bool = False,
             device: str = "cpu", capacity: float | None = None) -> MemoryPlan:
    """The plan of a TrainerConfig on a checkpoint (its config.json only), checked against `capacity` (default:
    `device`'s memory): raises PlanDoesNotFit when it cannot fit."""
    cfg = ModelConfig.from_dir(model_dir)
    plan = memory_plan(cfg, world=world, fsdp=fsdp, compute_bytes=compute_bytes,
                       master_bytes=8 if compute_bytes == 8 else 4, micro_batch_tokens=config.micro_batch_tokens,
                       activation_checkpointing=config.activation_checkpointing, vocab_chunk=config.vocab_chunk,
                       mxfp8_experts=config.mxfp8_experts, on_gpu=device.startswith("cuda"))
    plan.check(capacity if capacity is not None else capacity_bytes(device))
    return plan
