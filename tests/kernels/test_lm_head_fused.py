"""kernels/lm_head_triton.py (the sliced LM head's softmax work in one launch per slice) against
kernels/lm_head.py's torch version and autograd through the whole-vocabulary log_softmax."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.lm_head import chunked_logprobs
from kernels.op_count import OpCounter


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_logprobs_and_gradients_equal_the_torch_slices_and_the_whole_row(dtype, tol):
    """A vocabulary of 3 slices, the last one short (and shorter than the kernel's tile), targets in each slice."""
    from kernels.lm_head_triton import fused_chunked_logprobs

    g = torch.Generator().manual_seed(0)
    N, D, V, chunk = 9, 16, 2500, 1100
    h = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    targets = torch.tensor([0, 1099, 1100, 2199, 2200, 2499, 5, 1500, 2300])
    grad = torch.randn(N, generator=g)
    leaves = {}
    outs = {}
    for name, fn in (("fused", fused_chunked_logprobs), ("torch", chunked_logprobs),
                     ("whole", lambda a, b, t, c: F.log_softmax(F.linear(a, b).float(), -1).gather(1, t[:, None])[:, 0])):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        outs[name] = fn(a, b, targets, chunk)
        outs[name].backward(grad)
        leaves[name] = (a.grad, b.grad)
    for ref in ("torch", "whole"):
        assert (outs["fused"] - outs[ref]).abs().max() <= 1e-4 * outs[ref].abs().max()
        for x, y in zip(leaves["fused"], leaves[ref], strict=True):
            assert x.dtype == y.dtype and (x.float() - y.float()).abs().max() <= tol * y.float().abs().max()


def test_one_launch_per_slice_each_way():
    from kernels.lm_head_triton import fused_chunked_logprobs

    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(300, 8, requires_grad=True)
    t = torch.tensor([1, 100, 200, 299])
    counts = {}
    for name, fn in (("fused", fused_chunked_logprobs), ("torch", chunked_logprobs)):
        with OpCounter() as c:
            fn(h, w, t, 100).sum().backward()
        counts[name] = c
    assert counts["fused"].launches == {"lm_head_slice_stats": 3, "lm_head_slice_grad": 3}
    assert counts["torch"].total > 3 * counts["fused"].total, (counts["torch"].total, counts["fused"].total)
    with pytest.raises(ValueError, match="one of"):
        fused_chunked_logprobs(h, w.double(), t, 100)


def test_a_trainer_step_with_the_fused_lm_head_equals_the_default(tmp_path):
    """TrainerConfig.fused_lm_head: a vocabulary of 3 slices goes through the kernels (counted), and the step's
    loss and gradients equal the default trainer's to rounding (bf16 compute, the GPU's)."""
    import json

    from bench.train_ops import SMALL
    from bench.train_step import make_samples
    from train.trainer import Trainer, TrainerConfig

    (tmp_path / "config.json").write_text(json.dumps(dict(SMALL, num_hidden_layers=1, vocab_size=300)))
    samples = make_samples(300, 2, 16)
    out = {}
    for fused in (False, True):
        t = Trainer(tmp_path, TrainerConfig(load_format="dummy", dtype="bfloat16", device="cpu", lr=1e-3,
                                            vocab_chunk=100, fused_lm_head=fused))
        with OpCounter() as c:
            loss = t.step(samples, [1.0, -1.0])["loss"]
        out[fused] = (loss, {n: p.grad for n, p in t.model.named_parameters()}, c)
    assert out[True][2].launches["lm_head_slice_stats"] == 3 and out[True][2].launches["lm_head_slice_grad"] == 3
    assert out[False][0] == pytest.approx(out[True][0], rel=1e-3, abs=1e-6)
    for n, g in out[False][1].items():
        assert (out[True][1][n] - g).abs().max() <= 5e-2 * g.abs().max() + 1e-9, n
