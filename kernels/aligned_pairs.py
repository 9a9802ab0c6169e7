"""What kernels/moe_align.py returns and its Triton kernel (kernels/moe_align_triton.py) fills: the sorted,
block-padded (token, slot) pairs of a MoE layer and the sizes that bound them. Its own module, so that the
dispatcher and the kernel file import it and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Up to these sizes moe_align_block_size runs the one-launch kernel. Its single program loops over the
# pairs in chunks of a [pairs, experts] one-hot tile, so its time grows with P * E; beyond decode sizes
# (Qwen3-MoE: E = 128, K = 8, so 1024 pairs is 128 tokens) the reference's parallel ops win and the
# launch count no longer matters.
TRITON_MAX_PAIRS = 1024
TRITON_MAX_EXPERTS = 512


@dataclass(frozen=True)
class AlignedPairs:
    """sorted_pair_ids [P_max] int32: pair ids grouped by expert, each group padded with the value
    T*K (= num_pairs, "no pair") to a multiple of block_m; block_expert [P_max // block_m] int32: the
    expert of each block; num_padded [1] int32 on the device: how many entries of sorted_pair_ids are
    real (blocks at or past it are skipped)."""

    sorted_pair_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_pairs: int


def max_padded_length(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst case: every active expert (at most min(E, pairs) of them) wastes block_m - 1 slots."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m
