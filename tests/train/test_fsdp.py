"""FSDP2 on 2 CPU processes (gloo): one step equals the single-process Trainer's step on the same batch
(loss and updated weights, fp32 tolerance), the experts are sharded by expert, and a sharded DCP
checkpoint loads into a plain unsharded model."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as tmp

from tests.train.test_trainer import fixed_samples
from train.trainer import Trainer, TrainerConfig

ADVS = [1.0, -0.5, -0.5]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, tiny: str, out: str, budget: int, ckpt: bool = False) -> None:
    os.environ |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "TRITON_INTERPRET": "",
    }
    os.environ.pop("TRITON_INTERPRET")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from train.distributed.fsdp import FSDPTrainer, init_process_group

    init_process_group()
    try:
        trainer = FSDPTrainer(tiny, TrainerConfig(lr=1e-3, micro_batch_tokens=budget, activation_checkpointing=ckpt))
        w13 = trainer.model.layers[0].mlp.w13
        local_experts = w13.to_local().shape[0]
        m = trainer.step(fixed_samples(tiny), ADVS)
        full = trainer.full_state_dict()
        trainer.save_sharded(f"{out}/dcp", state={"next_batch": 1})
        trainer.save(f"{out}/serving", resumable=False)
        if rank == 0:
            torch.save(
                {"metrics": m, "full": full, "local_experts": local_experts, "experts": w13.shape[0]},
                f"{out}/rank0.pt",
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "activation-checkpointing"])
def test_fsdp_step_equals_single_process_and_dcp_loads_unsharded(tiny, tmp_path, ckpt):
    samples = fixed_samples(tiny)
    budget = max(
        len(s.token_ids) for s in samples
    )  # one sample per micro-batch: rank 1 pads with an empty pass
    tmp.spawn(_rank_main, args=(2, _free_port(), str(tiny), str(tmp_path), budget, ckpt), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)

    ref = Trainer(tiny, TrainerConfig(lr=1e-3, micro_batch_tokens=budget))
    before = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    m = ref.step(samples, ADVS)
    assert got["experts"] >= 2 and got["local_experts"] == got["experts"] // 2  # experts split across ranks
    assert got["metrics"]["loss"] == pytest.approx(m["loss"], rel=1e-5, abs=1e-6)
    assert got["metrics"]["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-4)
    changed = 0
    for name, p in ref.model.named_parameters():
        assert torch.allclose(got["full"][name], p.detach(), atol=2e-6, rtol=1e-5), name
        changed += not torch.equal(p.detach(), before[name])
    assert changed > 0

    # The sharded checkpoint, read by one process into the plain (unsharded) model.
    from train.distributed.fsdp import load_unsharded

    plain = Trainer(tiny, TrainerConfig()).model
    load_unsharded(tmp_path / "dcp", plain)
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), got["full"][name]), name
    # ... and the serving folder rank 0 exported is the one the single-process trainer writes.
    from safetensors.torch import load_file

    served = load_file(str(tmp_path / "serving" / "model.safetensors"))
    ours = load_file(str(ref.save(tmp_path / "ref", resumable=False) / "model.safetensors"))
    assert served.keys() == ours.keys()
    for k in ours:
        assert (
            torch.allclose(served[k].float(), ours[k].float(), atol=2e-6) or served[k].dtype == torch.uint8
        ), k
