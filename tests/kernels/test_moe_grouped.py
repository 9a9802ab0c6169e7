"""The MoE backward as grouped GEMMs (kernels/moe_grouped.py) against autograd through the reference, and
the grouped forward that serves plain bf16 experts on a GPU against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_grouped import moe_backward, moe_grouped_forward
from kernels.moe_reference import moe_reference
from kernels.op_count import OpCounter
from tests.kernels.moe_data import make_layer


def reference_grads(x, ids, w, w13, w2, grad):
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    moe_reference(leaves[0], ids, leaves[1], leaves[2], leaves[3]).backward(grad)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("variant", ["grouped", "fused"])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float64, 1e-12)])
def test_gradients_equal_autograd_through_the_reference(grouped, dtype, tol, variant):
    if grouped and dtype == torch.float64:
        pytest.skip("torch._grouped_mm takes no float64: the loop path runs it")
    x, ids, w, w13, w2 = (t.to(dtype) if t.is_floating_point() else t
                          for t in make_layer(40, 8, 2, 64, 32, seed=3, skew=True))
    assert torch.bincount(ids.reshape(-1), minlength=8).min() == 0  # an expert nobody picked
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours = moe_backward(grad, x, ids, w, w13, w2, grouped=grouped, variant=variant)
    theirs = reference_grads(x, ids, w, w13, w2, grad)
    for name, a, b in zip(("x", "weights", "w13", "w2"), ours, theirs, strict=True):
        assert a.shape == b.shape, name
        scale = b.abs().max().clamp_min(1e-6)
        assert ((a.float() - b.float()).abs().max() / scale) < tol, (name, dtype)
    unused = torch.bincount(ids.reshape(-1), minlength=8) == 0
    assert ours[2][unused].abs().max() == 0 and ours[3][unused].abs().max() == 0


@pytest.mark.parametrize("variant", ["grouped", "fused"])
def test_grouped_path_runs_a_fixed_number_of_ops_whatever_the_experts(variant):
    """No per-expert loop: the same ops for 4 experts or 64, and nothing that waits for the host."""
    counts = []
    for E in (4, 64):
        x, ids, w, w13, w2 = make_layer(64, E, 2, 64, 32, seed=E)
        grad = torch.randn_like(x)
        with OpCounter(strict=True) as c:
            moe_backward(grad, x, ids, w, w13, w2, grouped=True, variant=variant)
        counts.append(c.total)
    assert counts[0] == counts[1], counts
    with OpCounter() as loop:
        moe_backward(grad, x, ids, w, w13, w2, grouped=False)
    assert loop.total > 2 * counts[1]  # the per-expert loop the grouped path replaces


def test_grouped_calls_pass_torchs_cuda_checks_on_the_meta_device():
    """torch's meta kernel for _grouped_mm carries the CUDA kernel's checks (bf16, strides 16-byte aligned):
    every grouped GEMM of the backward passes them at the Qwen3-30B-A3B layer shape, and an unaligned
    width is caught, so the check is live."""
    def run(inter: int):
        m = dict(device="meta", dtype=torch.bfloat16)
        T, E, K, D = 4096, 128, 8, 2048
        ids = torch.empty(T, K, device="meta", dtype=torch.long)
        return moe_backward(torch.empty(T, D, **m), torch.empty(T, D, **m), ids, torch.empty(T, K, **m),
                            torch.empty(E, 2 * inter, D, **m), torch.empty(E, D, inter, **m), grouped=True)

    g_x, g_w, g_13, g_2 = run(768)
    assert g_x.shape == (4096, 2048) and g_13.shape == (128, 1536, 2048) and g_2.shape == (128, 2048, 768)
    with pytest.raises(RuntimeError, match="16 bytes"):
        run(767)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_forward_equals_the_reference(grouped, dtype, tol):
    x, ids, w, w13, w2 = (t.to(dtype) if t.is_floating_point() else t
                          for t in make_layer(40, 8, 2, 64, 32, seed=5, skew=True))
    ours = moe_grouped_forward(x, ids, w, w13, w2, grouped=grouped)
    ref = moe_reference(x, ids, w, w13, w2)
    assert ours.dtype == dtype and ours.shape == ref.shape
    assert (ours.float() - ref.float()).abs().max() / ref.float().abs().max() < tol


def test_grouped_forward_never_waits_for_the_host_and_fits_the_cuda_kernel():
    """What lets a decode step with plain experts be captured in a CUDA graph: the same ops whatever the
    routing, none that synchronises; and at the Qwen3-30B-A3B shape its grouped GEMMs pass the CUDA
    kernel's checks (meta device), at batch 1 as at 128."""
    counts = []
    for E in (4, 64):
        x, ids, w, w13, w2 = make_layer(16, E, 2, 64, 32, seed=E)
        with OpCounter(strict=True) as c:
            moe_grouped_forward(x, ids, w, w13, w2, grouped=True)
        counts.append(c.total)
    assert counts[0] == counts[1], counts
    m = dict(device="meta", dtype=torch.bfloat16)
    for T in (1, 128):
        ids = torch.empty(T, 8, device="meta", dtype=torch.long)
        out = moe_grouped_forward(torch.empty(T, 2048, **m), ids, torch.empty(T, 8, **m),
                                  torch.empty(128, 1536, 2048, **m), torch.empty(128, 2048, 768, **m), grouped=True)
        assert out.shape == (T, 2048) and out.dtype == torch.bfloat16


def test_the_fused_backward_dispatches_fewer_kernels_and_one_grouped_gemm_less():
    """Along the GPU code path (the SwiGLU kernel under the interpreter in this folder's tests): five grouped
    GEMMs instead of six and far fewer elementwise kernels; an unknown variant is refused by name."""
    x, ids, w, w13, w2 = (t.to(torch.bfloat16) if t.is_floating_point() else t
                          for t in make_layer(64, 8, 2, 64, 32, seed=2))
    grad = torch.randn_like(x)
    counts = {}
    for variant in ("grouped", "fused"):
        with OpCounter(strict=True) as c:
            moe_backward(grad, x, ids, w, w13, w2, grouped=True, variant=variant)
        counts[variant] = c
    assert counts["grouped"].ops["aten._grouped_mm"] == 6 and counts["fused"].ops["aten._grouped_mm"] == 5
    assert counts["fused"].total < counts["grouped"].total - 10, (counts["fused"].total, counts["grouped"].total)
    with pytest.raises(ValueError, match="expert backward must be one of"):
        moe_backward(grad, x, ids, w, w13, w2, variant="fast")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_kernel_equals_its_reference(dtype):
    """kernels/swiglu_triton.py (the interpreter here, the GPU there) against moe_grouped's torch reference,
    on an inter width that is not a power of two (masked lanes) and with a zero router weight."""
    from kernels.moe_grouped import swiglu_backward_reference
    from kernels.swiglu_triton import swiglu_backward_triton

    g = torch.Generator().manual_seed(0)
    P, inter = 13, 24
    gu = (torch.randn(P, 2 * inter, generator=g) * 3).to(dtype)
    ghu = torch.randn(P, inter, generator=g).to(dtype)
    w = torch.rand(P, generator=g)
    w[3] = 0
    ours = swiglu_backward_triton(gu, ghu, w)
    ref = swiglu_backward_reference(gu, ghu, w)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
    assert ours[0][3].abs().max() == 0 and ours[1][3].abs().max() == 0  # weight 0: no gradient, h scaled to 0
    with pytest.raises(ValueError, match="do not fit"):
        swiglu_backward_triton(gu, ghu[:, :-1], w)



def test_a_check_made_under_a_dispatch_mode_does_not_decide_for_the_process(monkeypatch):
    """grouped_available checks torch._grouped_mm once per dtype and device and caches the answer. Made under a
    dispatch mode in which the op cannot run (here one that refuses it, as a meta or fake mode may), the check
    fails; that answer must not stand for every later caller in the process, which would run the loop."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kernels import moe_grouped

    class NoGroupedMM(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._grouped_mm:
                raise RuntimeError("not in this mode")
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(moe_grouped, "_CHECKED", {})
    with NoGroupedMM():
        assert not moe_grouped.grouped_available(torch.float32, torch.device("cpu"))
    assert moe_grouped._CHECKED == {}
    assert moe_grouped.grouped_available(torch.float32, torch.device("cpu"))  # torch's CPU op runs float32
    assert moe_grouped._CHECKED == {("cpu", torch.float32): True}
