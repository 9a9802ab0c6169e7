"""oneDNN-packed weights for CPU inference give what the plain matmuls give, at every batch size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_pack
from kernels.moe_reference import moe_all_experts, moe_reference, pack_experts
from tests.kernels.moe_data import make_layer

pytestmark = pytest.mark.skipif(not cpu_pack.available(torch.float32), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 200])
def test_packed_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(300, 96, generator=g), torch.randn(300, generator=g)
    x = torch.randn(rows, 96, generator=g)
    packed = cpu_pack.pack(w)
    torch.testing.assert_close(cpu_pack.packed_linear(x, packed), x @ w.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_pack.packed_linear(x, packed, b), torch.nn.functional.linear(x, w, b),
                               rtol=1e-5, atol=1e-4)


def test_pack_linears_swaps_modules_and_keeps_outputs():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Sequential(nn.Linear(128, 32, bias=False)))
    x = torch.randn(2, 5, 64)  # leading dimensions are kept
    with torch.inference_mode():
        want = net(x)
        assert cpu_pack.pack_linears(net, min_elements=128 * 64 + 1) == 0  # both are too small
        assert cpu_pack.pack_linears(net, min_elements=0) == 2
        got = net(x)
    assert not any(type(m) is nn.Linear for m in net.modules())
    assert net[0].stored_bytes == (128 * 64 + 128) * 4
    assert got.shape == (2, 5, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pack_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="2-D CPU weight"):
        cpu_pack.pack(torch.zeros(2, 3, 4))


def test_all_experts_with_packed_experts_matches_the_grouped_reference():
    for T, E, K in ((1, 4, 4), (8, 16, 4), (64, 8, 2)):
        x, ids, w, w13, w2 = make_layer(T, E, K, 96, 48, seed=T)
        torch.testing.assert_close(moe_all_experts(x, ids, w, w13, w2, pack_experts(w13, w2)),
                                   moe_reference(x, ids, w, w13, w2), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_pack.available(torch.bfloat16), reason="no native bfloat16 on this CPU")
def test_bfloat16_packed_linear_is_close():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(256, 128, generator=g).bfloat16(), torch.randn(8, 128, generator=g).bfloat16()
    got = cpu_pack.packed_linear(x, cpu_pack.pack(w)).float()
    want = x.float() @ w.float().T
    assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.skipif(not cpu_pack.available(torch.bfloat16), reason="no native bfloat16 on this CPU")
def test_bfloat16_packed_experts_are_close_to_float32():
    x, ids, w, w13, w2 = make_layer(8, 16, 4, 96, 48, seed=2)
    b13, b2 = w13.bfloat16(), w2.bfloat16()
    got = moe_all_experts(x.bfloat16(), ids, w, b13, b2, pack_experts(b13, b2))
    want = moe_reference(x, ids, w, w13, w2)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 2e-2
