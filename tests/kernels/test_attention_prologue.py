"""The CPU attention prologue (csrc/attention_prologue_cpu.cpp) against the model's torch code."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_ext
from serve.model.layers import RMSNorm, apply_rope

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernel cannot be built here (the torch path stays)")


@pytest.fixture(scope="module")
def kernels():
    return cpu_ext.build()


def torch_prologue(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, H, G, C):
    """What Attention.forward does in torch between the projection and attention."""
    T = qkv.shape[0]
    q, k, v = qkv.split([H * C, G * C, G * C], dim=-1)
    q, k = q_norm(q.reshape(T, H, C)), k_norm(k.reshape(T, G, C))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v.reshape(T, G, C))
    return q


@pytest.mark.parametrize(("T", "H", "G", "C", "dtype", "tol"), [
    (1, 8, 4, 64, torch.float32, 1e-6), (37, 4, 2, 32, torch.float32, 1e-6), (5, 6, 3, 128, torch.bfloat16, 2e-2)])
def test_matches_the_torch_layers(kernels, T, H, G, C, dtype, tol):
    g = torch.Generator().manual_seed(T)
    qkv_full = torch.randn(T, (H + 2 * G) * C + 8, generator=g).to(dtype)
    qkv = qkv_full[:, : (H + 2 * G) * C]  # rows with a stride, as a view of a wider buffer
    q_norm, k_norm = RMSNorm(C, 1e-6), RMSNorm(C, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(C, generator=g) + 0.5)
        k_norm.weight.copy_(torch.rand(C, generator=g) + 0.5)
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    angles = torch.rand(T, C // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    slots = torch.randperm(3 * T, generator=g)[:T]
    caches = [torch.zeros(3 * T, G, C, dtype=dtype) for _ in range(4)]
    with torch.inference_mode():
        want = torch_prologue(qkv, q_norm, k_norm, cos, sin, caches[0], caches[1], slots, H, G, C)
        got = kernels.attention_prologue(qkv, q_norm.weight.float(), k_norm.weight.float(), 1e-6, cos, sin,
                                         caches[2], caches[3], slots, H)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(caches[2], caches[0], atol=tol, rtol=tol)
    assert torch.equal(caches[3], caches[1])  # values are copied as they are


def test_a_slot_outside_the_cache_is_refused(kernels):
    qkv = torch.randn(2, (2 + 2) * 16)
    w, cs = torch.ones(16), torch.ones(2, 16)
    k, v = torch.zeros(4, 1, 16), torch.zeros(4, 1, 16)
    with pytest.raises(RuntimeError, match="slot 4 is outside"):
        kernels.attention_prologue(qkv, w, w, 1e-6, cs, cs, k, v, torch.tensor([0, 4]), 2)
    assert not k.any() and not v.any()  # refused before anything was written
