"""Training in the served precision: the forward equals the served MXFP8 forward, the gradients are the
straight-through ones, and a model trained this way exports to exactly what it trained with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import (
    MXFP8Linear,
    MXFP8Tensor,
    fake_quantize_mxfp8,
    moe_forward,
    moe_reference,
    mxfp8_linear,
    mxfp8_moe,
)
from tests.kernels.moe_data import make_layer


def test_fake_quantize_is_the_round_trip_with_an_identity_gradient():
    w = torch.randn(8, 64, requires_grad=True)
    q = fake_quantize_mxfp8(w)
    assert torch.equal(q, MXFP8Tensor.quantize(w.detach()).dequantize(torch.float32))
    g = torch.randn_like(q)
    q.backward(g)
    assert torch.equal(w.grad, g)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_forward_and_gradients_are_straight_through(bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g, requires_grad=True)
    w = torch.randn(48, 64, generator=g, requires_grad=True)
    b = torch.randn(48, generator=g, requires_grad=True) if bias else None
    y = mxfp8_linear(x, w, b)
    grad = torch.randn_like(y)
    y.backward(grad)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_() if bias else None
    y2 = F.linear(x2, fake_quantize_mxfp8(w2), b2)
    y2.backward(grad)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(b.grad, b2.grad)


def test_a_layer_trained_in_mxfp8_serves_exactly_what_it_trained():
    torch.manual_seed(0)
    target = torch.nn.Linear(64, 32)
    layer = MXFP8Linear(64, 32)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(256, 64)
    with torch.no_grad():
        y = target(x)
    first = None
    for _ in range(60):
        loss = F.mse_loss(layer(x), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first  # it learns through the quantizer
    served = MXFP8Tensor.quantize(layer.weight.detach())
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, served.dequantize(torch.float32), layer.bias))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_forward_is_the_served_one_and_gradients_reach_the_masters(backend, device):
    # the Triton case on `device`: CPU tensors reach the kernel only under the interpreter, which
    # tests/kernels/conftest.py turns on only where there is no GPU
    dev = device if backend == "triton" else torch.device("cpu")
    x, ids, w, w13, w2 = (t.to(dev) for t in make_layer(6, 4, 2, 64, 32, seed=11))
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    out = mxfp8_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend=backend, mma="dequant")
    served = moe_forward(x, ids, w, MXFP8Tensor.quantize(w13), MXFP8Tensor.quantize(w2), backend=backend,
                         mma="dequant")
    assert torch.equal(out.detach(), served)
    grad = torch.randn_like(out)
    out.backward(grad)
    # The straight-through gradients: those of the reference on the round-tripped weights.
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    ref = moe_reference(ref_leaves[0], ids, ref_leaves[1], fake_quantize_mxfp8(ref_leaves[2]),
                        fake_quantize_mxfp8(ref_leaves[3]))
    ref.backward(grad)
    for ours, theirs in zip(leaves, ref_leaves, strict=True):
        assert ours.grad is not None and ours.grad.abs().sum() > 0
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)
