"""kernels/rms_norm_triton.py (the trainer's RMSNorm, one launch forward and one backward) against the model's
RMSNorm in torch ops (kernels/fused.rms_norm) and autograd through it: the Triton interpreter here, the GPU
there."""

from __future__ import annotations

import pytest
import torch

from kernels.fused import rms_norm
from kernels.op_count import OpCounter


@pytest.mark.parametrize("shape", [(3, 5, 4, 24), (7, 64)], ids=["heads-C24", "rows-C64"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_forward_and_gradients_equal_the_torch_norm(shape, dtype, tol):
    from kernels.rms_norm_triton import rms_norm_train

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    ours, ref = rms_norm_train(xa, wa, 1e-6), rms_norm(xb, wb, 1e-6)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    # the same rounding points: at most one ulp apart where the mean's summation order tips a rounding
    assert ((ours.float() - ref.float()).abs() <= 1e-2 * ref.float().abs() + 1e-6).all()
    ours.backward(dy)
    ref.backward(dy)
    for a, b in ((xa.grad, xb.grad), (wa.grad, wb.grad)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()


def test_two_launches_and_a_sum_instead_of_the_torch_ops():
    from kernels.rms_norm_triton import rms_norm_train

    x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(32, dtype=torch.bfloat16, requires_grad=True)
    counts = {}
    for name, fn in (("fused", rms_norm_train), ("torch", rms_norm)):
        with OpCounter() as c:
            fn(x, w, 1e-6).sum().backward()
        counts[name] = c
    assert counts["fused"].launches == {"rms_norm_fwd": 1, "rms_norm_bwd": 1}
    assert counts["torch"].total >= 2 * counts["fused"].total, (counts["torch"].total, counts["fused"].total)
    with pytest.raises(ValueError, match="one dtype"):
        rms_norm_train(x, w.float(), 1e-6)


def test_a_trainer_step_with_fused_norms_equals_the_default(tmp_path, dtype="bfloat16", tol=5e-2):
    """TrainerConfig.fused_norms: every RMSNorm of the model runs the kernels (counted), and the step's loss and
    gradients equal the default trainer's to rounding."""
    import json

    from bench.train_ops import SMALL
    from bench.train_step import make_samples
    from train.trainer import Trainer, TrainerConfig, TrainingRMSNorm

    (tmp_path / "config.json").write_text(json.dumps(dict(SMALL, num_hidden_layers=2, vocab_size=256)))
    samples = make_samples(256, 2, 16)
    out = {}
    for fused in (False, True):
        t = Trainer(tmp_path, TrainerConfig(load_format="dummy", dtype=dtype, device="cpu", lr=1e-3, fused_norms=fused))
        with OpCounter() as c:
            loss = t.step(samples, [1.0, -1.0])["loss"]
        out[fused] = (loss, {n: p.grad for n, p in t.model.named_parameters()}, c)
    norms = sum(isinstance(m, TrainingRMSNorm) for m in t.model.modules())
    assert norms == 2 * 4 + 1 and out[True][2].launches["rms_norm_fwd"] == norms
    assert out[False][0] == pytest.approx(out[True][0], rel=1e-3, abs=1e-6)
    for n, g in out[False][1].items():
        assert (out[True][1][n] - g).abs().max() <= tol * g.abs().max() + 1e-9, n
