"""The paged CPU decode attention kernel against gathering the pages and running SDPA."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_attention, cpu_ext

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernel cannot be built here (the torch path stays)")


@pytest.fixture(scope="module")
def module():
    return cpu_ext.build()  # ~30-60 s the first time on a machine, then cached


def pages(B: int, lens: list[int], G: int, C: int, block_size: int, dtype, seed: int = 0):
    """A cache with each sequence's blocks scattered at random, and what the kernel takes."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    total = sum(blocks) + 5  # spare blocks, never read
    k = torch.randn(total * block_size, G, C, generator=g).to(dtype)
    v = torch.randn(total * block_size, G, C, generator=g).to(dtype)
    order = torch.randperm(total, generator=g).tolist()
    tables, at = [], 0
    for n in blocks:
        tables.append(order[at : at + n] + [0] * (max(blocks) - n))  # padded with a block of someone else
        at += n
    return k, v, torch.tensor(tables), torch.tensor(lens)


@pytest.mark.parametrize(("H", "G", "C"), [(8, 4, 64), (4, 4, 32), (16, 2, 128), (6, 3, 48)])
def test_matches_gathered_sdpa(module, H, G, C):
    lens = [1, 17, 16, 190, 33, 5]
    k, v, tables, lens_B = pages(len(lens), lens, G, C, block_size=16, dtype=torch.float32)
    q = torch.randn(len(lens), H, C)
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens_B, 16, module)
    want = cpu_attention.reference(q, k, v, tables, lens_B, 16)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_strided_queries_and_bfloat16(module):
    lens = [40, 7, 129]
    k, v, tables, lens_B = pages(3, lens, 2, 64, block_size=8, dtype=torch.bfloat16, seed=1)
    qkv = torch.randn(3, (4 + 2 * 2) * 64).to(torch.bfloat16)  # q is a view into a fused projection's rows
    q = qkv[:, : 4 * 64].view(3, 4, 64)
    assert not q.is_contiguous()
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens_B, 8, module)
    want = cpu_attention.reference(q.float(), k.float(), v.float(), tables, lens_B, 8)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_a_length_beyond_the_block_table_is_refused(module):
    k, v, tables, lens_B = pages(2, [10, 20], 2, 32, block_size=16, dtype=torch.float32)
    q = torch.randn(2, 2, 32)
    with pytest.raises(RuntimeError, match="outside 1..32"):
        cpu_attention.paged_decode_attention(q, k, v, tables, torch.tensor([10, 33]), 16, module)
    with pytest.raises(RuntimeError, match="outside"):
        cpu_attention.paged_decode_attention(q, k, v, tables, torch.tensor([0, 5]), 16, module)


def test_load_finds_the_build_without_compiling(module):
    assert cpu_ext.load(build_in_background=False) is module
    assert (cpu_ext.build_dir() / f"{cpu_ext._name(cpu_ext.build_dir())}.so").exists()
