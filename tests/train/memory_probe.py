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

SHAPE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=32768, hidden_size=256,
             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=512,
             moe_intermediate_size=128, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")
SEQS, LENGTH = 4, 512


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def samples():
    import torch

    from train.samples import Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(SEQS):
        ids = torch.randint(10, SHAPE["vocab_size"] - 10, (LENGTH,), generator=g).tolist()
        s = Sample(episode=f"e{i}", segment=0, versions=[0], requests=1)
        s.extend(ids[: LENGTH // 2], sampled=False)
        s.extend(ids[LENGTH // 2:], sampled=True, logprobs=[-3.0] * (LENGTH - LENGTH // 2))
        out.append(s)
    return out


def measure(trainer) -> int:
    batch, adv = samples(), [1.0, -1.0] * (SEQS // 2)
    trainer.step(batch, adv)
    trainer.optimizer.zero_grad(set_to_none=True)
    Path("/proc/self/clear_refs").write_text("5")
    base = _kib("VmRSS")
    trainer.step(batch, adv)
    return (_kib("VmHWM") - base) * 1024


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
