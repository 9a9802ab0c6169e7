"""Sort (token, slot) pairs by expert and pad each expert's run to a multiple of the kernel's BLOCK_M.

The MoE kernels tile the sorted pairs in blocks of BLOCK_M rows; every block then belongs to exactly one
expert, so a program loads one expert's weights and applies them to up to BLOCK_M rows (vLLM's
moe_align_block_size does the same job in CUDA). Pair p = t * K + k stands for token t's k-th choice.

Two implementations with the same outputs, value for value, neither of which waits on the GPU: the output
has a fixed worst-case length, and the real length stays on the device (`num_padded`) for the kernels to
read.
- `moe_align_block_size_reference`: ~20 plain torch ops; runs anywhere, any size.
- kernels/moe_align_triton.py: one Triton launch (one program), for the few pairs of a decode step,
  where the reference's ~20 launches per MoE layer are the cost.
`moe_align_block_size` takes the kernel when `use_triton(device)` (kernels/backend.py) and the problem
fits it (1..TRITON_MAX_PAIRS pairs of a 2-D integer topk_ids, at most TRITON_MAX_EXPERTS experts), else
the reference.

Limits: expert ids are trusted to lie in [0, E) (checking them would cost a device sync); the kernel
drops an out-of-range id's pair, the reference raises (CPU) or trips a device assert (CUDA).
"""

from __future__ import annotations

import torch

from kernels.aligned_pairs import TRITON_MAX_EXPERTS, TRITON_MAX_PAIRS, AlignedPairs, max_padded_length
from kernels.backend import use_triton

__all__ = ["TRITON_MAX_EXPERTS", "TRITON_MAX_PAIRS", "AlignedPairs", "max_padded_length", "moe_align_block_size",
           "moe_align_block_size_reference"]


def moe_align_block_size(topk_ids_TK: torch.Tensor, block_m: int, num_experts: int) -> AlignedPairs:
    """Sort the T*K (token, slot) pairs by expert, each expert's run padded to a multiple of block_m."""
    if _fits_triton(topk_ids_TK, num_experts) and use_triton(topk_ids_TK.device):
        from kernels.moe_align_triton import moe_align_block_size_triton

        return moe_align_block_size_triton(topk_ids_TK, block_m, num_experts)
    return moe_align_block_size_reference(topk_ids_TK, block_m, num_experts)


def _fits_triton(topk_ids_TK: torch.Tensor, num_experts: int) -> bool:
    dtype = topk_ids_TK.dtype
    integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return (topk_ids_TK.dim() == 2 and integer and 1 <= topk_ids_TK.numel() <= TRITON_MAX_PAIRS
            and 1 <= num_experts <= TRITON_MAX_EXPERTS)


def moe_align_block_size_reference(topk_ids_TK: torch.Tensor, block_m: int, num_experts: int) -> AlignedPairs:
    """The torch ops; any size, any device. The definition the one-launch kernel is tested against."""
    device = topk_ids_TK.device
    expert_P = topk_ids_TK.reshape(-1).to(torch.int64)  # P = T*K pairs
    num_pairs = expert_P.numel()
    count_E = torch.zeros(num_experts, dtype=torch.int64, device=device)
    count_E.scatter_add_(0, expert_P, torch.ones_like(expert_P))  # bincount would sync on CUDA
    padded_E = (count_E + block_m - 1) // block_m * block_m
    padded_end_E = torch.cumsum(padded_E, 0)
    padded_start_E = padded_end_E - padded_E
    start_E = torch.cumsum(count_E, 0) - count_E

    order_P = torch.argsort(expert_P, stable=True)  # pair ids by expert, token order kept within one
    expert_sorted_P = expert_P[order_P]
    rank_P = torch.arange(num_pairs, device=device) - start_E[expert_sorted_P]
    dest_P = padded_start_E[expert_sorted_P] + rank_P

    length = max_padded_length(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((length,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest_P] = order_P.to(torch.int32)
    block_start_B = torch.arange(0, length, block_m, device=device)
    block_expert_B = torch.searchsorted(padded_end_E, block_start_B, right=True).clamp(max=num_experts - 1)
    return AlignedPairs(
        sorted_pair_ids=sorted_ids,
        block_expert=block_expert_B.to(torch.int32),
        num_padded=padded_end_E[-1:].to(torch.int32),
        block_m=block_m,
        num_pairs=num_pairs,
    )
