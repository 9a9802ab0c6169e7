"""The paged decode attention (Triton kernels under the interpreter on CPU, and the torch reference) against
SDPA over each sequence's gathered keys and values, built here slot by slot; and checks that neither path
synchronises with the host (the decode step is captured in CUDA graphs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.launches import on_launch
from kernels.op_count import OpCounter
from kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
from kernels.paged_attention_triton import MAX_SPLITS, choose_num_splits

# Lengths: one token, an exact multiple of the block size, a padding row, ragged, the whole table.
LENS = [1, 8, 0, 13, 24]
BLOCK_SIZE = 4
N = 6  # table width: 24 tokens


def make_case(lens: list[int], H: int, G: int, C: int, dtype: torch.dtype, seed: int = 0,
              table_dtype: torch.dtype = torch.int32, block_size: int = BLOCK_SIZE, n: int = N):
    """A cache whose blocks are handed out in shuffled order (so tables are out of order), tables padded
    with block 0 past each sequence's pages, and spare blocks no table names."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    num_blocks = B * n + 3
    q = torch.randn(B, H, C, generator=g).to(dtype)
    k = torch.randn(num_blocks * block_size, G, C, generator=g).to(dtype)
    v = torch.randn(num_blocks * block_size, G, C, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(B, n, dtype=table_dtype)
    for b, length in enumerate(lens):
        for j in range(-(-length // block_size)):
            tables[b, j] = free.pop()
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int64)


def expected(q, k, v, tables, lens, block_size: int, scale: float) -> torch.Tensor:
    """SDPA per sequence on its own slots, in float64; zeros for an empty sequence."""
    B, H, C = q.shape
    G = k.shape[1]
    out = torch.zeros(B, H, C, dtype=torch.float64)
    for b in range(B):
        length = int(lens[b])
        if length == 0:
            continue
        slots = [int(tables[b, t // block_size]) * block_size + t % block_size for t in range(length)]
        k_GLC = k[slots].double().transpose(0, 1)
        v_GLC = v[slots].double().transpose(0, 1)
        k_HLC = k_GLC.repeat_interleave(H // G, 0)
        v_HLC = v_GLC.repeat_interleave(H // G, 0)
        out[b] = F.scaled_dot_product_attention(q[b].double()[:, None], k_HLC, v_HLC, scale=scale)[:, 0]
    return out


HEADS = {"gqa": (8, 2), "mha": (4, 4)}


@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("heads", list(HEADS))
def test_triton_matches_sdpa_float32(heads, num_splits):
    H, G = HEADS[heads]
    q, k, v, tables, lens = make_case(LENS, H, G, 32, torch.float32, seed=num_splits)
    scale = 32**-0.5
    out = paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, scale, backend="triton",
                                 num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert (out[LENS.index(0)] == 0).all()
    torch.testing.assert_close(out.double(), expected(q, k, v, tables, lens, BLOCK_SIZE, scale),
                               rtol=1e-5, atol=1e-5)


def test_split_counts_agree():
    q, k, v, tables, lens = make_case(LENS, 8, 2, 32, torch.float32, seed=7)
    outs = [paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, 0.2, backend="triton", num_splits=s)
            for s in (1, 3, 6, None)]
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_sdpa_low_precision(dtype):
    q, k, v, tables, lens = make_case(LENS, 8, 2, 64, dtype, seed=3)
    scale = 64**-0.5
    out = paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, scale, backend="triton", num_splits=2)
    assert out.dtype == dtype
    # The oracle takes the same rounded inputs in float64: what is left is the output's rounding (bf16:
    # 2**-8 relative) and, on a GPU, the probabilities rounded to the input dtype before P @ V.
    torch.testing.assert_close(out.double(), expected(q, k, v, tables, lens, BLOCK_SIZE, scale),
                               rtol=2e-2, atol=2e-2)


def test_odd_shapes_and_strided_cache():
    """Head dim and group size that are not powers of two, a block size of 3, int64 tables and int32
    lengths, and caches that are strided views (one layer of a stacked [slots, 2, G, C] tensor)."""
    lens = [5, 0, 9, 1]
    q, k, v, tables, lens_B = make_case(lens, 6, 2, 24, torch.float32, seed=5, table_dtype=torch.int64,
                                        block_size=3, n=4)
    kv = torch.stack([k, v], dim=1)
    k_view, v_view = kv[:, 0], kv[:, 1]
    assert not k_view.is_contiguous()
    out = paged_decode_attention(q, k_view, v_view, tables, lens_B.int(), 3, 0.3, backend="triton",
                                 num_splits=2)
    torch.testing.assert_close(out.double(), expected(q, k, v, tables, lens_B, 3, 0.3), rtol=1e-5, atol=1e-5)


def test_lengths_past_the_table_are_clamped():
    q, k, v, tables, lens = make_case([24, 3], 4, 2, 16, torch.float32, seed=9)
    full = torch.tensor([24, 3])
    long = torch.tensor([40, 3])
    for backend in ("triton", "torch"):
        a = paged_decode_attention(q, k, v, tables, long, BLOCK_SIZE, 0.25, backend=backend, num_splits=2)
        b = paged_decode_attention(q, k, v, tables, full, BLOCK_SIZE, 0.25, backend=backend, num_splits=2)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", list(HEADS))
def test_reference_matches_sdpa(heads, dtype, tol):
    H, G = HEADS[heads]
    q, k, v, tables, lens = make_case(LENS, H, G, 32, dtype, seed=11)
    out = paged_decode_attention_reference(q, k, v, tables, lens, BLOCK_SIZE, 0.2)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected(q, k, v, tables, lens, BLOCK_SIZE, 0.2), rtol=tol, atol=tol)


def test_dispatch_and_launches():
    """"auto" on a CPU tensor under the interpreter runs the kernels (one launch, or two with splits);
    float64 and "torch" run the reference; the kernel refuses float64."""
    q, k, v, tables, lens = make_case(LENS, 4, 2, 16, torch.float32)
    names: list[str] = []
    with on_launch(names.append):
        paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, 0.25, num_splits=1)
        assert names == ["paged_attention_split"]
        names.clear()
        paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, 0.25, num_splits=3)
        assert names == ["paged_attention_split", "paged_attention_reduce"]
        names.clear()
        paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, 0.25, backend="torch")
        paged_decode_attention(q.double(), k.double(), v.double(), tables, lens, BLOCK_SIZE, 0.25)
        assert names == []
    with pytest.raises(ValueError, match="float64"):
        paged_decode_attention(q.double(), k.double(), v.double(), tables, lens, BLOCK_SIZE, 0.25,
                               backend="triton")


def test_num_splits_heuristic():
    assert choose_num_splits(0, 16) == 1
    assert choose_num_splits(1, 16) == 1
    assert choose_num_splits(32, 16) == 1  # 512 tokens
    assert choose_num_splits(64, 16) == 2
    assert choose_num_splits(10_000, 16) == MAX_SPLITS
    assert all(choose_num_splits(n, bs) <= n for n in range(1, 200) for bs in (1, 16, 64))


def test_argument_checks():
    q, k, v, tables, lens = make_case([3, 2], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :3], k, v, tables, lens, BLOCK_SIZE, 0.25)
    with pytest.raises(TypeError, match="dtype"):
        paged_decode_attention(q, k.bfloat16(), v, tables, lens, BLOCK_SIZE, 0.25)
    with pytest.raises(TypeError, match="int32 or int64"):
        paged_decode_attention(q, k, v, tables.float(), lens, BLOCK_SIZE, 0.25)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(q, k, v, tables, lens[:1], BLOCK_SIZE, 0.25)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, 0.25, backend="triton", num_splits=0)


@pytest.mark.parametrize("backend,num_splits", [("triton", 1), ("triton", 3), ("torch", None)])
def test_no_host_sync(backend, num_splits):
    q, k, v, tables, lens = make_case(LENS, 8, 2, 16, torch.float32, seed=2)
    want = expected(q, k, v, tables, lens, BLOCK_SIZE, 0.25)
    with OpCounter(strict=True):
        out = paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, 0.25, backend=backend,
                                     num_splits=num_splits)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


