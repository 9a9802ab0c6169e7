"""moe_align_block_size: every pair exactly once, blocks of one expert, padding in the right places; the
one-launch Triton kernel equal to the torch reference in every field, one launch, no host sync."""

from __future__ import annotations

import pytest
import torch

from kernels import AlignedPairs, moe_align_block_size
from kernels.launches import on_launch
from kernels.moe_align import (
    TRITON_MAX_EXPERTS,
    TRITON_MAX_PAIRS,
    max_padded_length,
    moe_align_block_size_reference,
)
from kernels.moe_align_triton import moe_align_block_size_triton
from kernels.op_count import OpCounter


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


# ---------------------------------------------------------------- the one-launch kernel against the reference

def _routing(seed: int) -> tuple[torch.Tensor, int, int]:
    """Random top-k ids (distinct experts per token) with T in 1..40, K in 1..8, E in 4..128 and block_m
    16 or 64. Odd seeds: one expert picked by every token, and a third of the experts picked by none."""
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 41, (1,), generator=g))
    E = int(torch.randint(4, 129, (1,), generator=g))
    K = min(int(torch.randint(1, 9, (1,), generator=g)), E)
    block_m = (16, 64)[seed // 2 % 2]
    if seed % 2 == 0:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    else:
        perm = torch.randperm(E, generator=g)
        popular, pool = perm[0], perm[1:max(K, E - E // 3)]  # perm[E - E // 3:] is never picked
        rows = [torch.cat([popular[None], pool[torch.randperm(pool.numel(), generator=g)[:K - 1]]])
                for _ in range(T)]
        ids = torch.stack([r[torch.randperm(K, generator=g)] for r in rows])  # popular in any slot
    return ids, block_m, E


def _assert_same(got: AlignedPairs, want: AlignedPairs) -> None:
    for field in ("sorted_pair_ids", "block_expert", "num_padded"):
        g, w = getattr(got, field), getattr(want, field)
        assert g.dtype == w.dtype == torch.int32 and g.shape == w.shape, field
        assert torch.equal(g.cpu(), w.cpu()), field
    assert (got.block_m, got.num_pairs) == (want.block_m, want.num_pairs)


@pytest.mark.parametrize("seed", range(24))
def test_triton_matches_reference(seed, device):
    ids, block_m, E = _routing(seed)
    if seed % 2:  # the routing the test means to cover is really there
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        assert counts.max() == ids.shape[0] and (counts == 0).any()
    ids = ids.to(device)
    want = moe_align_block_size_reference(ids, block_m, E)
    _assert_same(moe_align_block_size_triton(ids, block_m, E), want)
    _assert_same(moe_align_block_size_triton(ids.int(), block_m, E), want)  # int32 ids as the router's


@pytest.mark.parametrize("T,K,E,block_m", [(1, 1, 4, 16), (40, 8, 128, 64), (40, 8, 8, 16), (128, 8, 512, 64),
                                           (7, 3, 10, 24), (17, 1, 1, 16)])
def test_triton_matches_reference_at_the_edges(T, K, E, block_m, device):
    """At the caps (1024 pairs, 512 experts: several chunks in every loop), every token on most experts,
    a single expert, a block_m that is no power of two."""
    g = torch.Generator().manual_seed(T + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    _assert_same(moe_align_block_size_triton(ids, block_m, E), moe_align_block_size_reference(ids, block_m, E))


def test_triton_refuses_past_its_caps(device):
    ids = torch.zeros((1, 1), dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="experts"):
        moe_align_block_size_triton(ids, 16, TRITON_MAX_EXPERTS + 1)
    with pytest.raises(ValueError, match="pairs"):
        moe_align_block_size_triton(torch.zeros((TRITON_MAX_PAIRS + 1, 1), dtype=torch.int64, device=device), 16, 4)
    with pytest.raises(TypeError, match="integer"):
        moe_align_block_size_triton(ids.float(), 16, 4)


def test_triton_reads_strided_ids_in_place(device):
    ids_KT = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(t))[:4] for t in range(9)]).t()
    ids_TK = ids_KT.contiguous().to(device).t()  # [9, 4] with strides (1, 9)
    assert not ids_TK.is_contiguous()
    _assert_same(moe_align_block_size_triton(ids_TK, 16, 16),
                 moe_align_block_size_reference(ids_TK.contiguous(), 16, 16))


def test_one_launch_and_no_host_sync(device):
    ids, block_m, E = _routing(5)
    ids = ids.to(device)
    launches: list[str] = []
    mode = OpCounter(strict=True)
    with torch.inference_mode(), on_launch(launches.append), mode:
        got = moe_align_block_size(ids, block_m, E)
    assert launches == ["moe_align"]
    assert not mode.ops, mode.ops  # nothing but the three outputs' allocations (not counted)
    _assert_same(got, moe_align_block_size_reference(ids, block_m, E))


def test_large_problems_take_the_reference(device):
    """Past the caps (and for no pairs) moe_align_block_size runs the torch ops: no launch, same result."""
    g = torch.Generator().manual_seed(0)
    big = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(TRITON_MAX_PAIRS // 8 + 1)])
    many_experts = torch.stack([torch.randperm(TRITON_MAX_EXPERTS + 1, generator=g)[:2] for _ in range(3)])
    for ids, E in ((big, 128), (many_experts, TRITON_MAX_EXPERTS + 1), (torch.zeros((0, 2), dtype=torch.int64), 4)):
        launches: list[str] = []
        with on_launch(launches.append):
            got = moe_align_block_size(ids.to(device), 16, E)
        assert launches == []
        _assert_same(got, moe_align_block_size_reference(ids.to(device), 16, E))


def test_triton_drops_an_out_of_range_expert(device):
    """A documented limit: ids are trusted; one outside [0, E) loses its pair instead of writing out of
    bounds (the reference raises)."""
    ids = torch.tensor([[0, 2], [9, 1]], device=device)
    a = moe_align_block_size_triton(ids, 16, 4)
    assert int(a.num_padded.item()) == 48
    assert sorted(i for i in a.sorted_pair_ids.tolist() if i < 4) == [0, 1, 3]
