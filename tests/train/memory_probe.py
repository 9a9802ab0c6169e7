"""Measures what one trainer step adds to a process's memory, for tests/train/test_memory_plan.py.

    python tests/train/memory_probe.py OUT.json [--ranks 2]

Run with MALLOC_MMAP_THRESHOLD_=65536 (every allocation above 64 KiB its own mapping, returned on free,
so resident memory is live memory). A reduced Qwen3-MoE shape with random weights; one warm step (first
allocations, library code paged in), then the gradients dropped and one measured step: the high-water
mark of resident memory (reset through /proc/self/clear_refs) above what was resident when it began.
With --ranks N, FSDP2 on N gloo processes, each measuring its own.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.train_step import REDUCED, make_samples, status_kib  # noqa: E402

SHAPE = dict(REDUCED, num_hidden_layers=2)
SEQS, LENGTH = 4, 512


def measure(trainer) -> int:
    batch, adv = make_samples(SHAPE["vocab_size"], SEQS, LENGTH), [1.0, -1.0] * (SEQS // 2)
    trainer.step(batch, adv)
    trainer.optimizer.zero_grad(set_to_none=True)
    Path("/proc/self/clear_refs").write_text("5")
    base = status_kib("VmRSS")
    trainer.step(batch, adv)
    return (status_kib("VmHWM") - base) * 1024


def _rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(world)}
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from train.distributed.fsdp import FSDPTrainer, init_process_group
    from train.trainer import TrainerConfig

    init_process_group()
    try:
        trainer = FSDPTrainer(model, TrainerConfig(load_format="dummy", lr=1e-5, micro_batch_tokens=4096))
        Path(out, f"rank{rank}.json").write_text(json.dumps({"step_bytes": measure(trainer)}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    out, ranks = Path(sys.argv[1]), int(sys.argv[3]) if "--ranks" in sys.argv else 1
    model = Path(tempfile.mkdtemp(prefix="memory-probe-"))
    (model / "config.json").write_text(json.dumps(SHAPE))
    os.environ.pop("TRITON_INTERPRET", None)
    if ranks == 1:
        import torch

        from train.trainer import Trainer, TrainerConfig

        torch.set_num_threads(1)
        trainer = Trainer(model, TrainerConfig(load_format="dummy", lr=1e-5, micro_batch_tokens=4096))
        result = {"step_bytes": [measure(trainer)]}
    else:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(ranks, port, str(model), str(model)), nprocs=ranks, join=True)
        result = {"step_bytes": [json.loads((model / f"rank{r}.json").read_text())["step_bytes"]
                                 for r in range(ranks)]}
    out.write_text(json.dumps(result | {"shape": SHAPE, "seqs": SEQS, "len": LENGTH, "ranks": ranks}))


if __name__ == "__main__":
    main()
