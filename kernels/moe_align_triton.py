"""moe_align_block_size in one Triton launch, for the few pairs of a decode step.

The torch reference (kernels/moe_align.py) spends ~20 small kernels per MoE layer on this: a histogram,
cumsums, a stable argsort, gathers, a fill and a scatter. Here one program does all of it, so a decode
step captured in a CUDA graph holds one node per layer for the alignment instead of ~20. Same outputs,
value for value (the tests compare every field with the reference).

Approach (one program, int32 throughout, E = num_experts, P = T*K pairs, pair p = token p // K, slot p % K):
1. Fill: every entry of sorted_pair_ids gets num_pairs ("no pair"); a barrier, so that pass 3's pair
   writes land after it (step 3 writes a subset of the same addresses from other threads).
2. Counts: over chunks of pairs, a one-hot tile hit[p, e] = (expert_p == e) summed over p. From them:
   padded counts (up to a multiple of BLOCK_M), their inclusive cumsum (padded_end), num_padded (the
   total), and block_expert[b] = #{e : padded_end[e] <= b * BLOCK_M} clamped to E - 1, which is what the
   reference's searchsorted(padded_end, block_start, right=True).clamp(max=E - 1) gives, for the blocks
   past num_padded too (E - 1 there).
3. Pairs: the same chunks again; the one-hot tile's cumsum down the pairs, plus the per-expert count of
   earlier chunks, is each pair's 1-based rank among the pairs of its expert in pair order (the
   reference's stable argsort order), so dest = padded_start[expert] + rank - 1 and
   sorted_pair_ids[dest] = p.
The one-hot tiles cost O(P * E) work instead of a sort; at decode sizes (P <= 1024, E <= 512) that is a
few chunks of CHUNK_P x BLOCK_E elements (TILE in all), and the kernel compiles once per (BLOCK_E,
BLOCK_M), not per batch size: the pair count, top-k and lengths are runtime arguments.

Graph-capture properties: outputs come from torch.empty; no other torch op, no host sync, the grid is
(1,) and every size the host needs is a function of shapes (max_padded_length).

Limits: P <= TRITON_MAX_PAIRS and E <= TRITON_MAX_EXPERTS (kernels/moe_align.py routes larger problems
to the torch reference; one program's time grows with P * E); at least one pair; topk_ids 2-D with an
integer dtype (any strides: read in place, no copy). Expert ids are trusted to lie in [0, E) like the
reference's; an id outside it is dropped here (not counted, not written, its pair appears nowhere) where
the reference raises (CPU) or trips a device assert (CUDA). Not yet run on a GPU, only under the
interpreter: the fill-then-scatter order relies on tl.debug_barrier (bar.sync) ordering one program's
global stores, and TILE / NUM_WARPS are first guesses, not timed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.aligned_pairs import TRITON_MAX_EXPERTS, TRITON_MAX_PAIRS, AlignedPairs, max_padded_length
from kernels.launches import launch

# Elements of one [chunk, BLOCK_E] int32 tile: 8192 is 32 registers a thread with 8 warps.
TILE = 8192
FILL_CHUNK = 1024
NUM_WARPS = 8


@triton.jit
def _chunk_hits(ids_ptr, p0, num_pairs, top_k, stride_t, stride_k, e_E, real_E, CHUNK_P: tl.constexpr):
    """Pairs p0 .. p0 + CHUNK_P: (pair ids, in range, one-hot [CHUNK_P, BLOCK_E] of each pair's expert)."""
    p_P = p0 + tl.arange(0, CHUNK_P)
    ok_P = p_P < num_pairs
    t_P = p_P // top_k
    expert_P = tl.load(ids_ptr + t_P * stride_t + (p_P - t_P * top_k) * stride_k, mask=ok_P,
                       other=-1).to(tl.int32)  # -1 (masked rows) matches no expert
    return p_P, ok_P, ((expert_P[:, None] == e_E[None, :]) & real_E[None, :]).to(tl.int32)


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                      num_pairs, top_k, num_experts, length, num_blocks, stride_t, stride_k,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK_P: tl.constexpr,
                      CHUNK_B: tl.constexpr, FILL: tl.constexpr):
    e_E = tl.arange(0, BLOCK_E)
    real_E = e_E < num_experts  # lanes past E: never hit, so an id >= E is dropped, not miscounted

    # 1. Fill, then a barrier: step 3 overwrites some of these entries from other threads, and bar.sync
    # orders a program's global stores (no separate torch.full launch, no classification of padding).
    fill_X = tl.zeros((FILL,), dtype=tl.int32) + num_pairs
    for x0 in range(0, length, FILL):
        x_X = x0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + x_X, fill_X, mask=x_X < length)

    # 2. Per-expert counts, padded to BLOCK_M.
    count_E = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK_P):
        _, _, hit_PE = _chunk_hits(ids_ptr, p0, num_pairs, top_k, stride_t, stride_k, e_E, real_E, CHUNK_P)
        count_E += tl.sum(hit_PE, axis=0)
    padded_E = (count_E + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end_E = tl.cumsum(padded_E, axis=0)
    padded_start_E = padded_end_E - padded_E
    tl.store(num_padded_ptr, tl.sum(padded_E, axis=0))

    # Block b starts at b * BLOCK_M; its expert is the number of padded ranges ending at or before that
    # start (searchsorted right=True), clamped to E - 1 as the reference clamps the blocks past the end.
    for b0 in range(0, num_blocks, CHUNK_B):
        b_B = b0 + tl.arange(0, CHUNK_B)
        ended_BE = (padded_end_E[None, :] <= (b_B * BLOCK_M)[:, None]) & real_E[None, :]
        expert_B = tl.minimum(tl.sum(ended_BE.to(tl.int32), axis=1), num_experts - 1)
        tl.store(block_expert_ptr + b_B, expert_B, mask=b_B < num_blocks)

    tl.debug_barrier()  # the fill of step 1 is done (all threads) before any pair is written

    # 3. Each pair's destination: padded_start[e] + (pairs of e before it). seen_E counts earlier chunks,
    # the inclusive cumsum down the chunk counts this one's (1-based, hence the - 1 in slot_E).
    seen_E = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK_P):
        p_P, ok_P, hit_PE = _chunk_hits(ids_ptr, p0, num_pairs, top_k, stride_t, stride_k, e_E, real_E, CHUNK_P)
        slot_E = padded_start_E + seen_E - 1
        dest_P = tl.sum(hit_PE * (slot_E[None, :] + tl.cumsum(hit_PE, axis=0)), axis=1)
        known_P = ok_P & (tl.sum(hit_PE, axis=1) > 0)  # an out-of-range id has no row to go to
        tl.store(sorted_ptr + dest_P, p_P, mask=known_P)
        seen_E += tl.sum(hit_PE, axis=0)


def _block_e(num_experts: int) -> int:
    """The expert axis of the tiles: a power of two, at least 16 (fewer tiny-shape compiles)."""
    return max(16, triton.next_power_of_2(num_experts))


def moe_align_block_size_triton(topk_ids_TK: torch.Tensor, block_m: int, num_experts: int) -> AlignedPairs:
    """kernels.moe_align.moe_align_block_size in one launch; same arguments, same AlignedPairs."""
    if topk_ids_TK.dim() != 2 or topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype.is_complex \
            or topk_ids_TK.dtype == torch.bool:
        raise TypeError(f"topk_ids_TK must be a 2-D integer tensor, not {topk_ids_TK.dtype} "
                        f"{tuple(topk_ids_TK.shape)}")
    T, K = topk_ids_TK.shape
    P = T * K
    if not (1 <= P <= TRITON_MAX_PAIRS and 1 <= num_experts <= TRITON_MAX_EXPERTS and block_m >= 1):
        raise ValueError(f"the one-launch kernel takes 1..{TRITON_MAX_PAIRS} pairs, 1..{TRITON_MAX_EXPERTS} "
                         f"experts and block_m >= 1, not {P}, {num_experts}, {block_m}")
    device = topk_ids_TK.device
    length = max_padded_length(P, num_experts, block_m)
    num_blocks = length // block_m
    sorted_ids = torch.empty(length, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    be = _block_e(num_experts)
    chunk = max(1, TILE // be)
    with launch("moe_align"):
        _moe_align_kernel[(1,)](
            topk_ids_TK, sorted_ids, block_expert, num_padded,
            P, K, num_experts, length, num_blocks, topk_ids_TK.stride(0), topk_ids_TK.stride(1),
            BLOCK_M=block_m, BLOCK_E=be, CHUNK_P=chunk, CHUNK_B=chunk, FILL=FILL_CHUNK,
            num_warps=NUM_WARPS)
    return AlignedPairs(sorted_pair_ids=sorted_ids, block_expert=block_expert, num_padded=num_padded,
                        block_m=block_m, num_pairs=P)
