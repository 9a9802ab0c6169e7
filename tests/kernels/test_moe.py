"""The fused MoE: Triton kernels (interpreter on CPU) against the grouped torch reference, the grouped
reference against the dense one, and the moe_forward seam's dispatch and checks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kernels import MXFP8Tensor, moe_forward, moe_reference, moe_reference_dense
from kernels.moe_triton import choose_tiles
from tests.kernels.moe_data import make_layer

CASES = {  # (T, E, K, D, inter, skew)
    "single-token-top1": (1, 4, 1, 64, 32, False),
    "single-token-top4": (1, 16, 4, 64, 64, False),
    "few-tokens": (7, 8, 2, 96, 32, False),
    "skewed-empty-experts": (21, 8, 3, 64, 32, True),  # experts with > BLOCK_M pairs and with none
}


@pytest.mark.parametrize("E,K", [(4, 1), (16, 4)])
def test_grouped_reference_matches_dense(E, K):
    x, ids, w, w13, w2 = make_layer(11, E, K, 64, 32, seed=E)
    torch.testing.assert_close(moe_reference(x, ids, w, w13, w2), moe_reference_dense(x, ids, w, w13, w2),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mma", ["dequant", "dot_scaled"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference_float32(case, mma, device):
    """float32 activations: the interpreter's dot is float32 too, so the tolerance is tight."""
    T, E, K, D, inter, skew = CASES[case]
    x, ids, w, w13, w2 = make_layer(T, E, K, D, inter, seed=len(case), skew=skew)
    q13, q2 = MXFP8Tensor.quantize(w13, backend="torch"), MXFP8Tensor.quantize(w2, backend="torch")
    ref = moe_reference(x, ids, w, q13, q2, act_mxfp8=mma == "dot_scaled")
    dev = [t.to(device) for t in (x, ids, w)]
    out = moe_forward(*dev, MXFP8Tensor(q13.data.to(device), q13.scales.to(device)),
                      MXFP8Tensor(q2.data.to(device), q2.scales.to(device)), backend="triton", mma=mma)
    assert out.shape == (T, D) and out.dtype == torch.float32
    # On a GPU the kernel multiplies bf16 operands; under the interpreter it is float32 throughout.
    tol = 1e-5 if device.type == "cpu" else 3e-2
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("case", ["single-token-top4", "skewed-empty-experts"])
def test_kernel_matches_reference_bfloat16(case, device):
    T, E, K, D, inter, skew = CASES[case]
    x, ids, w, w13, w2 = make_layer(T, E, K, D, inter, seed=3, skew=skew)
    q13, q2 = MXFP8Tensor.quantize(w13, backend="torch"), MXFP8Tensor.quantize(w2, backend="torch")
    x = x.bfloat16()
    ref = moe_reference_dense(x, ids, w, q13, q2)  # float32 math on the same bf16 inputs
    out = moe_forward(x.to(device), ids.to(device), w.to(device),
                      MXFP8Tensor(q13.data.to(device), q13.scales.to(device)),
                      MXFP8Tensor(q2.data.to(device), q2.scales.to(device)), backend="triton")
    assert out.dtype == torch.bfloat16
    # bf16 output rounding (2**-8) plus, on a GPU, bf16 operands and a bf16 intermediate.
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_mxfp8_layer_stays_close_to_the_bf16_layer():
    """What quantizing the experts costs: e4m3 keeps 3 mantissa bits, about 3-4% RMS error per weight,
    and two quantized matmuls run in series; measured 4.7% here. Not zero (it did quantize), not more."""
    x, ids, w, w13, w2 = make_layer(16, 8, 2, 256, 128, seed=7)
    exact = moe_reference(x, ids, w, w13, w2)
    quant = moe_forward(x, ids, w, MXFP8Tensor.quantize(w13), MXFP8Tensor.quantize(w2), backend="torch")
    rel = (quant - exact).norm() / exact.norm()
    assert 1e-2 < rel < 6e-2


def test_seam_dispatch_and_checks(device):
    x, ids, w, w13, w2 = make_layer(3, 4, 2, 64, 32)
    q13, q2 = MXFP8Tensor.quantize(w13), MXFP8Tensor.quantize(w2)
    torch.testing.assert_close(moe_forward(x, ids, w, w13, w2), moe_reference(x, ids, w, w13, w2))
    torch.testing.assert_close(moe_forward(x, ids, w, q13, q2, backend="torch"),
                               moe_reference(x, ids, w, q13.dequantize(torch.float32),
                                             q2.dequantize(torch.float32)))
    with pytest.raises(TypeError, match="both"):
        moe_forward(x, ids, w, q13, w2)
    with pytest.raises(ValueError, match="MXFP8"):
        moe_forward(x, ids, w, w13, w2, backend="triton")
    with pytest.raises(ValueError, match="w13"):
        moe_forward(x, ids, w, w2, w13)
    with pytest.raises(ValueError, match="T=3"):
        moe_forward(x, ids[:2], w[:2], w13, w2)
    # an empty batch through the kernel, on `device`: CPU tensors reach the Triton kernel only under the
    # interpreter, which tests/kernels/conftest.py turns on only where there is no GPU
    q13, q2 = (MXFP8Tensor(q.data.to(device), q.scales.to(device)) for q in (q13, q2))
    out = moe_forward(x[:0].to(device), ids[:0].to(device), w[:0].to(device), q13, q2, backend="triton")
    assert out.shape == (0, 64) and out.device.type == device.type


def test_reference_is_differentiable():
    x, ids, w, w13, w2 = make_layer(5, 4, 2, 32, 32)
    params = [t.requires_grad_() for t in (x, w, w13, w2)]
    moe_forward(x, ids, w, w13, w2).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


@pytest.mark.parametrize("T", [5, 80])
def test_gpu_tile_shapes_compute_the_same_under_the_interpreter(T, device):
    """The tests above use the interpreter's tiles; run the GPU's decode (T <= 64) and prefill tiles too,
    so that their masking and K loops are checked before any GPU sees them."""
    from kernels.moe_triton import fused_moe_mxfp8

    x, ids, w, w13, w2 = make_layer(T, 4, 2, 256, 128, seed=T)
    q13, q2 = MXFP8Tensor.quantize(w13, backend="torch"), MXFP8Tensor.quantize(w2, backend="torch")
    ref = moe_reference(x, ids, w, q13, q2)
    q13, q2 = (MXFP8Tensor(q.data.to(device), q.scales.to(device)) for q in (q13, q2))
    out = fused_moe_mxfp8(x.to(device), ids.to(device), w.to(device), q13, q2, mma="dequant",
                          tiles=choose_tiles(T, interpret=False))
    tol = 1e-5 if device.type == "cpu" else 3e-2
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_decode_tiles_put_each_active_expert_in_one_block():
    for T in (1, 2, 5, 16, 17, 64):
        assert choose_tiles(T, interpret=False).block_m >= T  # a token picks an expert at most once
    assert choose_tiles(4096, interpret=False).block_m == 64


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 200])
def test_gpu_qwen3_shapes(T):
    x, ids, w, w13, w2 = make_layer(T, 128, 8, 2048, 768, seed=T)
    q13, q2 = MXFP8Tensor.quantize(w13.cuda()), MXFP8Tensor.quantize(w2.cuda())
    x, ids, w = x.bfloat16().cuda(), ids.cuda(), w.cuda()
    ref = moe_reference(x.float(), ids, w, q13, q2)
    out = moe_forward(x, ids, w, q13, q2, mma="dequant")
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
    if torch.cuda.get_device_capability()[0] >= 10:
        ref = moe_reference(x.float(), ids, w, q13, q2, act_mxfp8=True)
        out = moe_forward(x, ids, w, q13, q2, mma="dot_scaled")
        torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


def test_grouped_cpu_path_matches_the_grouped_reference():
    from kernels.moe_reference import moe_grouped_cpu

    for T, E, K in ((1, 16, 4), (3, 16, 2), (2, 8, 1), (40, 8, 2)):
        x, ids, w, w13, w2 = make_layer(T, E, K, 96, 48, seed=T)
        ids[-1, 0] = ids[0, 0]  # an expert shared by two tokens
        want = moe_reference(x, ids, w, w13, w2)
        torch.testing.assert_close(moe_grouped_cpu(x, ids, w, w13, w2), want, rtol=1e-5, atol=1e-5)
        with torch.inference_mode():
            torch.testing.assert_close(moe_forward(x, ids, w, w13, w2), want, rtol=1e-5, atol=1e-5)


def test_all_experts_cpu_path_matches_the_grouped_reference():
    from kernels.moe_reference import moe_all_experts

    for T, E, K in ((4, 8, 2), (16, 16, 4), (64, 8, 1)):
        x, ids, w, w13, w2 = make_layer(T, E, K, 96, 48, seed=T)
        want = moe_reference(x, ids, w, w13, w2)
        torch.testing.assert_close(moe_all_experts(x, ids, w, w13, w2), want, rtol=1e-5, atol=1e-5)
        with torch.inference_mode():
            torch.testing.assert_close(moe_forward(x, ids, w, w13, w2), want, rtol=1e-5, atol=1e-5)


def _bench_kernels():
    """bench/kernels.py as a module (not a package; its name would clash with the kernels package)."""
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).parents[2] / "bench" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["single-token-top1", "single-token-top4", "few-tokens", "skewed-empty-experts"])
def test_bench_grouped_mm_baseline_matches_the_reference(case, dtype, device):
    """bench/kernels.py's bf16 baseline (torch's grouped GEMM, as transformers' grouped_mm experts run it)
    computes the layer: float32 on the CPU within float32 rounding of the grouped reference; bf16 (on the
    GPU where there is one) within bf16 rounding of float32 math on the same bf16 inputs."""
    bench = _bench_kernels()
    if dtype == torch.float32:
        device = torch.device("cpu")  # CUDA's grouped_mm is bf16 only
    if (problem := bench.grouped_mm_problem(device)) is not None:
        pytest.skip(f"no grouped_mm on {device}: {problem}")
    T, E, K, D, inter, skew = CASES[case]
    x, ids, w, w13, w2 = make_layer(T, E, K, D, inter, seed=5, skew=skew)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    out = bench.moe_grouped_mm_bf16(x.to(device), ids.to(device), w.to(device), w13.to(device), w2.to(device))
    assert out.shape == (T, D) and out.dtype == dtype and out.device.type == device.type
    if dtype == torch.float32:
        ref = moe_reference(x, ids, w, w13, w2)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    else:
        ref = moe_reference_dense(x.float(), ids, w, w13.float(), w2.float())
        torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
