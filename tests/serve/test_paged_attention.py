"""paged_attention's prefill: new tokens after a cached prefix (an agent's every later turn, a long
prompt's later chunks) against plain causal attention over the whole sequence, and on the CPU flash kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from serve.model.layers import AttnMeta, SeqSlice, paged_attention

H, G, C = 8, 4, 32  # query heads, kv heads, head dim


def full_causal(q_HLC, k_GLC, v_GLC):
    rep = H // G
    return F.scaled_dot_product_attention(q_HLC, k_GLC.repeat_interleave(rep, 0), v_GLC.repeat_interleave(rep, 0),
                                          is_causal=True)


def prefill_after(cached: int, new: int, dtype=torch.float32, seed=0):
    """paged_attention on the last `new` tokens of a cached+new sequence whose K/V lie scattered in the cache;
    returns (its output, the same rows of attention over the whole sequence at once, the profiler's ops)."""
    g = torch.Generator().manual_seed(seed)
    L = cached + new
    q_HLC, k_GLC, v_GLC = (torch.randn(n, L, C, generator=g, dtype=dtype) for n in (H, G, G))
    slots_L = torch.randperm(2 * L, generator=g)[:L]  # pages anywhere in the cache
    k_cache, v_cache = torch.zeros(2 * L, G, C, dtype=dtype), torch.zeros(2 * L, G, C, dtype=dtype)
    k_cache[slots_L], v_cache[slots_L] = k_GLC.transpose(0, 1), v_GLC.transpose(0, 1)
    meta = AttnMeta(slot_mapping_T=slots_L[cached:], prefill=[SeqSlice(0, new, L, slots_L)],
                    decode_rows_B=torch.empty(0, dtype=torch.long))
    with profile() as prof:
        got_THC = paged_attention(q_HLC[:, cached:].transpose(0, 1).contiguous(), k_cache, v_cache, meta, G)
    want_THC = full_causal(q_HLC, k_GLC, v_GLC)[:, cached:].transpose(0, 1)
    return got_THC, want_THC, {e.key for e in prof.key_averages()}


@pytest.mark.parametrize(("cached", "new"), [(0, 40), (64, 40), (100, 1), (37, 150)])
def test_new_tokens_after_a_cached_prefix_equal_full_causal_attention(cached, new):
    got, want, _ = prefill_after(cached, new)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_bfloat16_after_a_cached_prefix():
    got, want, _ = prefill_after(48, 30, dtype=torch.bfloat16, seed=1)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cached", [0, 96])
def test_cpu_prefill_takes_the_flash_kernel_not_the_math_path(cached):
    """The math path materialises [H, Q, L] scores: ~2x slower than flash for a 283-token turn after 1,968
    cached tokens (BENCHMARKS). SDPA picks it silently for enable_gqa or unsupported inputs."""
    _, _, ops = prefill_after(cached, 64)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("new", [2, 9, 16])
def test_a_few_rows_after_a_cached_prefix_skip_the_flash_kernel(new, dtype):
    """A short draft verified after a cache (speculative decoding on a CPU): two batched matmuls on the
    gathered keys, each row seeing the cache and the draft up to itself; the same values as the full pass."""
    got, want, ops = prefill_after(200, new, dtype=dtype, seed=new)
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in ops
