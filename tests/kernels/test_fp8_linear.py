"""kernels/fp8_linear_triton.py against the torch reference (the interpreter on a CPU), and no host syncs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.fp8_block import fp8_linear, fp8_linear_reference, quantize_block_fp8
from kernels.op_count import OpCounter


@pytest.mark.parametrize("M,N,K,bias", [(1, 96, 200, False), (5, 160, 256, True), (16, 64, 128, False),
                                        (40, 136, 96, True), (80, 64, 160, False)])
def test_kernel_matches_reference(device, M, N, K, bias):
    """Decode rows (1-64, split-K on) and a prefill-sized M (80), partial scale blocks on N and K."""
    g = torch.Generator().manual_seed(M * 1000 + N)
    w = torch.randn(N, K, generator=g) * 0.05
    data, s = (t.to(device) for t in quantize_block_fp8(w))
    x = torch.randn(M, K, generator=g).to(device)
    b = torch.randn(N, generator=g).to(device) if bias else None
    got = fp8_linear(x, data, s, b, backend="triton")
    want = fp8_linear_reference(x, data, s, b)
    assert got.shape == (M, N) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bfloat16_activations(device):
    """bf16 in and out: the kernel's float32 sum rounded once, within one bf16 ulp of the reference."""
    g = torch.Generator().manual_seed(7)
    data, s = (t.to(device) for t in quantize_block_fp8(torch.randn(64, 128, generator=g)))
    x = torch.randn(3, 128, generator=g).to(device, torch.bfloat16)
    got = fp8_linear(x, data, s, backend="triton")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), fp8_linear_reference(x, data, s).float(), rtol=2**-7, atol=1e-2)


def test_no_host_sync_and_static_launches(device):
    """Capturable: no host sync, and the same launches whatever the values (shapes only decide)."""
    data, s = (t.to(device) for t in quantize_block_fp8(torch.randn(64, 128)))
    sigs = []
    for seed in (0, 1):
        x = torch.randn(4, 128, generator=torch.Generator().manual_seed(seed)).to(device)
        with OpCounter(strict=True) as c:
            fp8_linear(x, data, s, backend="triton")
        assert c.launches["fp8_linear"] == 1 and not c.syncs
        sigs.append(c.signature)
    assert sigs[0] == sigs[1]


def test_shape_errors(device):
    data, s = (t.to(device) for t in quantize_block_fp8(torch.randn(64, 128)))
    with pytest.raises(ValueError, match="does not fit"):
        fp8_linear(torch.randn(2, 64, device=device), data, s, backend="triton")
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_linear(torch.randn(2, 128, device=device), data, s[:, :0], backend="triton")


def _decode_ops():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "decode_ops.py"
    spec = importlib.util.spec_from_file_location("decode_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fp8_dense_layers_in_the_gpu_decode_step(device):
    """--quant-dense fp8 as a GPU runs it (FP8Linear modules, the Triton kernel under the interpreter): the
    eager forward matches the same model with FP8-rounded plain weights, and the static decode step (the one
    CUDA graphs capture) runs the FP8 kernel for q/k/v, o and the LM head with no host sync."""
    from serve.engine.base import SamplingParams
    from serve.engine.sequence import Sequence
    from serve.model.fp8 import FP8Linear, quantize_dense

    ops = _decode_ops()
    cfg = ops.SMALL
    logits = []
    for keep in (True, False):
        model, blocks, runner = ops.build(cfg, "none", 1, str(device))
        n, err = quantize_dense(model, keep_fp8=keep)
        assert n == 2 * cfg["num_hidden_layers"] + 1 and 0.01 < err < 0.05
        seq = Sequence([5, 9, 100, 7, 3, 44], SamplingParams(max_tokens=4))
        assert blocks.allocate(seq)
        logits.append(runner.run([(seq, len(seq))])[1])
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, FP8Linear)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    model, blocks, runner = ops.build(cfg, "mxfp8", 1, str(device))  # the GPU path: MXFP8 experts too
    quantize_dense(model, keep_fp8=True)
    assert isinstance(model.lm_head, FP8Linear) and isinstance(model.layers[0].self_attn.qkv_proj, FP8Linear)
    seqs = ops.prefill(blocks, runner, 1, cfg["vocab_size"])
    counter = ops.step("static", blocks, runner, seqs, strict=True)
    assert counter.launches["fp8_linear"] == 2 * cfg["num_hidden_layers"] + 1 and not counter.syncs


def test_split_k_partials_added_by_the_next_norm_give_the_same_bits(device):
    """reduce=False hands the split-K partials [M, S, N] to add_rms_norm (the decode step's o projection):
    the same sum and residual as reducing first, two kernels fewer (no torch sum, no cast)."""
    from kernels.fused import add_rms_norm

    g = torch.Generator().manual_seed(3)
    data, s = (t.to(device) for t in quantize_block_fp8(torch.randn(64, 256, generator=g) * 0.05))
    x = torch.randn(2, 256, generator=g).to(device)
    parts = fp8_linear(x, data, s, backend="triton", reduce=False)
    assert parts.dim() == 3 and parts.shape[0] == 2 and parts.shape[2] == 64 and parts.shape[1] > 1
    residual, w = torch.randn(2, 64, generator=g).to(device), torch.rand(64, generator=g).to(device) + 0.5
    with OpCounter(strict=True) as ops:
        got = add_rms_norm(parts, residual, w, 1e-6)
    want = add_rms_norm(fp8_linear(x, data, s, backend="triton"), residual, w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ops.total == 1  # the norm's own launch
    bias = torch.randn(64, generator=g).to(device)  # a bias: reduced as before (the norm adds no bias)
    assert fp8_linear(x, data, s, bias, backend="triton", reduce=False).shape == (2, 64)
