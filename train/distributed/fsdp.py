"""The trainer on FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and AdamW moments
sharded over the ranks of the default process group, experts included.

Each decoder layer is one FSDP unit and the root (embeddings, final norm, head) another. Every
parameter is sharded on dim 0, so the stacked expert weights w13 [E, 2I, D] / w2 [E, D, I] are split
by expert: a rank holds E / world experts of each layer and their optimizer moments. A layer's full
weights exist only while that layer runs (all-gather before, freed after), so the forward is the
unchanged serving model code, MXFP8 straight-through experts included. This is data parallel with
sharded state (ZeRO-3), not expert parallel: tokens are not routed across ranks.

A step takes the whole batch on every rank; rank r trains on samples r, r + world, ... with each
micro-batch's loss scaled against the *global* token and sequence counts and gradients summed (not
averaged) across ranks, so one step equals the single-process `Trainer.step` on the same batch.
Ranks run the same number of micro-batches (a rank with fewer runs zero-weighted ones: the FSDP
collectives must match).

Checkpoints: `save_sharded` writes torch.distributed.checkpoint (DCP: every rank its shards, no
gather); `load_unsharded` reads one into a plain single-process model; `save` gathers the full
weights to rank 0 and writes the serving folder composer-serve loads (what weight sync sends).

Limits: every rank reads the base checkpoint into host memory before sharding it (device memory only
ever holds shards and one unsharded layer); rank 0 needs host memory for one full copy to export.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from train.algo import LossConfig
from train.checkpoint import save_policy
from train.samples import Sample
from train.trainer import Trainer, TrainerConfig, micro_batches, pad


def init_process_group() -> tuple[int, int]:
    """Join the job torchrun (or a test's spawn) set up in the environment: gloo on CPU, nccl on GPUs."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    return dist.get_rank(), dist.get_world_size()


class FSDPTrainer(Trainer):
    # The masked path reads the root's embedding, norm and head outside forward_train, where FSDP
    # keeps them sharded: score through the registered forward instead.
    score_trained_only = False
    # FSDP2 gathers the weights in the compute dtype itself (MixedPrecisionPolicy.param_dtype); unlike the
    # single-process trainer it then quantizes MXFP8 experts from that copy, not from the float32 master
    cast_weights = False

    def __init__(
        self, model_dir: str | Path, config: TrainerConfig | None = None, loss: LossConfig | None = None
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "FSDPTrainer needs a process group: run under torchrun or call init_process_group()"
            )
        config = config or TrainerConfig()
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.plan_device = device  # the memory plan is for the ranks' devices, not the host that loads
        super().__init__(model_dir, TrainerConfig(**{**config.__dict__, "device": "cpu"}), loss)
        self.config = config
        self.device = (
            torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        )
        from torch.distributed.device_mesh import init_device_mesh

        for moe in self.model.moe_layers():  # FSDP gathers the experts into reused buffers: re-quantize each time
            moe.quant_cache = None

        self.mesh = init_device_mesh(self.device.type, (self.world,))
        mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=self.model.embed_tokens.weight.dtype)
        for layer in self.model.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp)
            register_fsdp_forward_method(layer, "forward_dense")  # forward_train calls this, not forward
        fully_shard(self.model, mesh=self.mesh, mp_policy=mp)
        register_fsdp_forward_method(self.model, "forward_train")
        register_fsdp_forward_method(self.model, "target_logprobs")  # the chunked LM head (large vocabularies)
        for m in [
            *self.model.layers,
            self.model,
        ]:  # sum, not mean: each rank's loss is its share of the batch
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no AVG / PREMUL_SUM)
            m.set_gradient_divide_factor(1.0)
        self.model.to(self.device)
        c = self.config
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=c.lr, betas=c.betas, weight_decay=c.weight_decay, foreach=True
        )
        self._export_model = None

    # -- one optimizer step over all ranks -------------------------------------------------------------------

    def step(self, samples: list[Sample], advantages: list[float], sft: bool = False) -> dict[str, Any]:
        if not samples:
            raise ValueError("a step needs at least one sample")
        t0 = time.monotonic()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(sum(s.mask[1:]) for s in samples) or 1
        n_seqs = len(samples)
        mine = list(range(self.rank, n_seqs, self.world))
        groups = (
            [
                [mine[j] for j in g]
                for g in micro_batches([samples[i] for i in mine], self.config.micro_batch_tokens)
            ]
            if mine
            else []
        )
        n_mb = torch.tensor([len(groups)])
        dist.all_reduce(n_mb, op=dist.ReduceOp.MAX)
        groups += [[]] * (int(n_mb) - len(groups))  # zero-weighted passes keep the collectives in step
        loss_sum = torch.zeros(1, dtype=torch.float64)
        sums: dict[str, float] = {}
        gap = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)  # sum, count, max over fresh samples
        for group in groups:
            if not group:
                ids, _, _ = pad([samples[0]], self.device)
                (self._token_logprobs(ids).sum() * 0.0).backward()
                continue
            mb = [samples[i] for i in group]
            loss, diff, mask_BT = self._micro_step(mb, [advantages[i] for i in group] if not sft else None,
                                                   total_tokens, n_seqs, sums)
            loss_sum += loss
            for row, s in enumerate(mb):
                if s.min_version == self.policy_version and max(s.versions) == self.policy_version:
                    d = diff[row][mask_BT[row] > 0].double().cpu()
                    if d.numel():
                        gap += torch.tensor([float(d.sum()), d.numel(), 0.0], dtype=torch.float64)
                        gap[2] = max(float(gap[2]), float(d.max()))
        c = self.config
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, c.grad_clip if c.grad_clip > 0 else math.inf)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        self.optimizer.step()
        self.step_count += 1
        self.policy_version += 1
        names = sorted(sums)
        totals = torch.cat([loss_sum, torch.tensor([sums[k] for k in names], dtype=torch.float64), gap[:2]])
        dist.all_reduce(totals)
        gap_max = gap[2:].clone()
        dist.all_reduce(gap_max, op=dist.ReduceOp.MAX)
        out = {
            "loss": float(totals[0]),
            "grad_norm": float(grad_norm),
            "samples": n_seqs,
            "train_tokens": total_tokens,
            "train_s": round(time.monotonic() - t0, 4),
            "ranks": self.world,
        }
        out |= {f"loss_{k}": float(totals[1 + i]) for i, k in enumerate(names)}
        if float(totals[-1]) > 0:
            out |= {"logprob_gap_max": float(gap_max[0]), "logprob_gap_mean": float(totals[-2] / totals[-1])}
        return out

    # -- checkpoints ---------------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights on rank 0's CPU (empty on other ranks); every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def save(
        self, out_dir: str | Path, *, state: dict[str, Any] | None = None, resumable: bool = True
    ) -> Path:
        """The serving folder (rank 0 writes it; all ranks take part in the gather). With `resumable`,
        also the sharded DCP training state in OUT/training-dcp."""
        out_dir = Path(out_dir)
        full = self.full_state_dict()
        if self.rank == 0:
            if self._export_model is None:  # a plain CPU copy to write from, built once
                self._export_model = Trainer(
                    self.base_dir, TrainerConfig(**{**self.config.__dict__, "device": "cpu"})
                ).model
            self._export_model.load_state_dict(full)
            save_policy(
                self._export_model,
                self.base_dir,
                out_dir,
                policy_version=self.policy_version,
                step=self.step_count,
                mxfp8_experts=self.config.mxfp8_experts,
            )
        dist.barrier()
        if resumable:
            self.save_sharded(out_dir / "training-dcp", state=state)
        return out_dir

    def save_sharded(self, ckpt_dir: str | Path, *, state: dict[str, Any] | None = None) -> Path:
        """Every rank writes its own shards of weights and optimizer moments (torch.distributed.checkpoint)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        ckpt_dir = Path(ckpt_dir)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt_dir))
        if self.rank == 0:
            (ckpt_dir / "state.json").write_text(
                json.dumps(
                    {"step": self.step_count, "policy_version": self.policy_version, **(state or {})},
                    indent=2,
                )
            )
        dist.barrier()
        return ckpt_dir

    def resume(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Load a `save_sharded` checkpoint (any earlier world size: DCP reshards on load)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        d = Path(ckpt_dir)
        d = d / "training-dcp" if (d / "training-dcp").is_dir() else d
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        blob = {"model": model_sd, "optim": optim_sd}
        dcp.load(blob, checkpoint_id=str(d))
        set_state_dict(
            self.model, self.optimizer, model_state_dict=blob["model"], optim_state_dict=blob["optim"]
        )
        state = json.loads((d / "state.json").read_text())
        self.step_count, self.policy_version = int(state["step"]), int(state["policy_version"])
        return state


def load_unsharded(ckpt_dir: str | Path, model: torch.nn.Module) -> torch.nn.Module:
    """Read the weights of a sharded DCP checkpoint into a plain model, in one process (no process
    group); the model must have the training layout (`to_training`). Returns the model."""
    import torch.distributed.checkpoint as dcp

    d = Path(ckpt_dir)
    d = d / "training-dcp" if (d / "training-dcp").is_dir() else d
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(d))
    model.load_state_dict(sd["model"])
    return model


class Leader:
    """Rank 0's face of an FSDP trainer inside `train.rl.run`: every call that changes the model is first
    broadcast to the other ranks (each running `follow`), then run here; all ranks run it together."""

    def __init__(self, trainer: FSDPTrainer):
        self.inner = trainer

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:  # counters the loop bumps live in the trainer
        if name == "inner":
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def _tell(self, *cmd) -> None:
        dist.broadcast_object_list([cmd], src=0)

    def step(self, samples: list[Sample], advantages: list[float], sft: bool = False) -> dict[str, Any]:
        self._tell("step", samples, advantages, sft, self.inner.policy_version, self.inner.step_count)
        return self.inner.step(samples, advantages, sft)

    def save(
        self, out_dir: str | Path, *, state: dict[str, Any] | None = None, resumable: bool = True
    ) -> Path:
        self._tell("save", str(out_dir), state, resumable, self.inner.policy_version, self.inner.step_count)
        return self.inner.save(out_dir, state=state, resumable=resumable)

    def resume(self, ckpt_dir: str | Path) -> dict[str, Any]:
        self._tell("resume", str(ckpt_dir))
        return self.inner.resume(ckpt_dir)

    def stop(self) -> None:
        self._tell("stop")


def follow(trainer: FSDPTrainer) -> None:
    """A rank other than 0: do what the leader broadcasts until it says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        cmd, *args = box[0]
        if cmd == "stop":
            return
        if cmd == "resume":
            trainer.resume(args[0])
            continue
        *rest, trainer.policy_version, trainer.step_count = args  # the leader's counters (it may skip steps)
        if cmd == "step":
            trainer.step(*rest)
        elif cmd == "save":
            trainer.save(rest[0], state=rest[1], resumable=rest[2])
