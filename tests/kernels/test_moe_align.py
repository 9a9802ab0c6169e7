"""moe_align_block_size: every pair exactly once, blocks of one expert, padding in the right places."""

from __future__ import annotations

import pytest
import torch

from kernels import moe_align_block_size
from kernels.moe_align import max_padded_length


def _check(ids_TK: torch.Tensor, block_m: int, E: int):
    a = moe_align_block_size(ids_TK, block_m, E)
    P = ids_TK.numel()
    sorted_ids = a.sorted_pair_ids.tolist()
    n = int(a.num_padded.item())
    assert len(sorted_ids) == max_padded_length(P, E, block_m) >= n and n % block_m == 0
    assert sorted(i for i in sorted_ids if i < P) == list(range(P))  # every pair exactly once
    assert all(i == P for i in sorted_ids[n:])  # nothing real past num_padded
    flat = ids_TK.reshape(-1).tolist()
    for b in range(n // block_m):
        rows = [i for i in sorted_ids[b * block_m:(b + 1) * block_m] if i < P]
        assert rows, "a real block has at least one pair"
        assert all(flat[i] == a.block_expert[b].item() for i in rows)
        assert rows == sorted(rows)  # token order kept within an expert
    counts = torch.bincount(ids_TK.reshape(-1), minlength=E)
    assert n == int(((counts + block_m - 1) // block_m * block_m).sum())
    return a


@pytest.mark.parametrize("T,K,E,block_m", [(1, 1, 4, 16), (1, 4, 16, 16), (9, 2, 8, 16), (40, 3, 5, 16),
                                           (33, 4, 16, 32), (5, 2, 128, 64)])
def test_random_routing(T, K, E, block_m, device):
    g = torch.Generator().manual_seed(T * 100 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    _check(ids.to(device), block_m, E)


def test_skewed_routing_and_empty_experts(device):
    ids = torch.tensor([[0, 3]] * 20 + [[3, 1]], device=device)  # experts 2, 4..7 get nothing
    a = _check(ids, 16, 8)
    experts = a.block_expert[: int(a.num_padded.item()) // 16].tolist()
    assert experts == [0, 0, 1, 3, 3]


def test_decode_reads_each_active_expert_once(device):
    """With T <= block_m no expert spans two blocks: one block, one read of the weights, per expert."""
    ids = torch.tensor([[5, 2, 7], [2, 9, 5], [11, 5, 2]], device=device)
    a = _check(ids, 16, 16)
    real = a.block_expert[: int(a.num_padded.item()) // 16].tolist()
    assert real == [2, 5, 7, 9, 11]


def test_no_tokens(device):
    a = moe_align_block_size(torch.zeros((0, 2), dtype=torch.int64, device=device), 16, 4)
    assert a.sorted_pair_ids.numel() == 0 and int(a.num_padded.item()) == 0
