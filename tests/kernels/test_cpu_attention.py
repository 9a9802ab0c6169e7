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


# The float64 few-query kernel (csrc/few_query_attention_cpu.cpp): one sequence's last Q queries over its
# keys where they lie in the pages, against the torch path on the gathered keys (serve/model/layers.py).


def scattered(L: int, G: int, C: int, seed: int, block_size: int = 16):
    """A float64 cache with the sequence's blocks scattered among spare ones, and its slots in order."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-L // block_size)
    total = blocks + 7
    k = torch.randn(total * block_size, G, C, generator=g, dtype=torch.float64)
    v = torch.randn(total * block_size, G, C, generator=g, dtype=torch.float64)
    order = torch.randperm(total, generator=g)[:blocks]
    slots = (order[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:L].contiguous()
    return k, v, slots


@pytest.mark.parametrize(("H", "G", "C"), [(8, 4, 16), (4, 4, 64), (16, 2, 128), (6, 3, 24)])
@pytest.mark.parametrize(("L", "Q"), [(1, 1), (9, 1), (64, 1), (65, 3), (200, 9), (700, 16), (129, 129)])
def test_few_query_kernel_matches_the_torch_path(module, H, G, C, L, Q):
    from serve.model.layers import few_query_attention

    k, v, slots = scattered(L, G, C, seed=L * Q + C)
    q = torch.randn(Q, H, C, dtype=torch.float64) * 3  # sharp softmaxes too
    got = module.few_query_attention(q, k, v, slots, C ** -0.5)
    want = few_query_attention(q, k.index_select(0, slots), v.index_select(0, slots), L - Q)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_few_query_rows_do_not_depend_on_how_many_are_asked(module):
    """A verify step's row i equals, to the bit, the decode of that position alone: what lets speculation
    keep greedy output identical with the kernel on."""
    k, v, slots = scattered(300, 4, 16, seed=3)
    q = torch.randn(9, 8, 16, dtype=torch.float64)
    together = module.few_query_attention(q, k, v, slots, 0.25)
    for i in range(9):
        alone = module.few_query_attention(q[i : i + 1], k, v, slots[: 300 - 9 + 1 + i].contiguous(), 0.25)
        assert torch.equal(together[i], alone[0]), i


def test_few_query_kernel_takes_strided_rows_and_refuses_bad_input(module):
    k, v, slots = scattered(50, 2, 16, seed=5)
    qkv = torch.randn(4, (4 + 2 * 2) * 16, dtype=torch.float64)  # q as a view into fused projection rows
    q = qkv[:, : 4 * 16].view(4, 4, 16)
    assert not q.is_contiguous()
    torch.testing.assert_close(module.few_query_attention(q, k, v, slots, 0.25),
                               module.few_query_attention(q.contiguous(), k, v, slots, 0.25), atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="float64 only"):
        module.few_query_attention(q.float(), k.float(), v.float(), slots, 0.25)
    with pytest.raises(RuntimeError, match="outside the cache"):
        module.few_query_attention(q, k, v, torch.cat([slots[:-1], torch.tensor([k.shape[0]])]), 0.25)
    with pytest.raises(RuntimeError, match="Q <= L"):
        module.few_query_attention(q, k, v, slots[:3].contiguous(), 0.25)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        module.few_query_attention(torch.randn(1, 2, 12, dtype=torch.float64), torch.zeros(8, 2, 12, dtype=torch.float64),
                                   torch.zeros(8, 2, 12, dtype=torch.float64), torch.arange(8), 0.25)
