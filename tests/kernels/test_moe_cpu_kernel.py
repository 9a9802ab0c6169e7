"""The CPU grouped-experts kernel (csrc/moe_cpu.cpp) against the grouped reference."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_ext
from kernels.moe import block_experts, blocked, moe_forward, moe_grouped_kernel, unblock_experts
from kernels.moe_reference import moe_reference
from tests.kernels.moe_data import make_layer

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernel cannot be built here (the torch path stays)")


@pytest.fixture(scope="module")
def kernels():
    return cpu_ext.build()


def input_major_copy(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.fixture(scope="module")
def block(kernels):
    return lambda w: block_experts(w, kernels.moe_block_columns())


@pytest.mark.parametrize(("T", "E", "K", "D", "inter", "skew"), [
    (1, 8, 2, 64, 32, False),  # one token: two experts with one row each
    (8, 32, 4, 128, 64, False),  # decode: 1-2 rows per expert (the streaming loop)
    (40, 4, 2, 96, 48, True),  # skew: some experts past 16 rows (the library GEMM), some empty
    (5, 6, 3, 70, 22, False),  # sizes that are not multiples of 4 or 8 (a last block of 6 or 12 columns)
    (300, 4, 2, 128, 64, False),  # prefill: ~150 rows an expert (float32: the loop, with torch's SiLU; bf16: GEMM)
    (1200, 4, 2, 64, 32, False),  # ~600 rows an expert: the library GEMM (oneDNN's for float32)
])
def test_matches_the_grouped_reference(kernels, block, T, E, K, D, inter, skew):
    x, ids, w, w13, w2 = make_layer(T, E, K, D, inter, seed=T, skew=skew)
    want = moe_reference(x, ids, w, w13, w2)
    with torch.inference_mode():
        got = moe_grouped_kernel(x, ids, w, block(w13), block(w2), kernels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("T", "E", "K", "D", "inter"), [
    (20, 2, 1, 48, 24),  # 10 rows an expert: one group of rows; a full block and a half-padded one
    (96, 4, 2, 128, 64),  # ~48 rows an expert: balanced groups over each block, still streamed for float32
    (3, 8, 3, 256, 128),  # 1-2 rows
])
def test_register_blocked_rows_match_the_reference(kernels, block, T, E, K, D, inter):
    x, ids, w, w13, w2 = make_layer(T, E, K, D, inter, seed=T + D)
    want = moe_reference(x, ids, w, w13, w2)
    with torch.inference_mode():
        got = moe_grouped_kernel(x, ids, w, block(w13), block(w2), kernels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("T", "E", "K", "D", "inter"), [
    (8, 32, 4, 128, 64),  # decode: 1-2 rows an expert
    (24, 4, 2, 64, 32),  # 11-13 rows an expert: one pass of the bf16 loop
    (5, 6, 3, 70, 22),  # widths that are not whole vectors: a part of the last block stored
])
def test_bfloat16_weights_are_widened_exactly(kernels, block, T, E, K, D, inter):
    """bf16 in, float32 accumulation: against the float32 reference on the same bf16-rounded values, the
    only difference left is the output's own rounding to bf16."""
    x, ids, w, w13, w2 = make_layer(T, E, K, D, inter, seed=T + 1)
    xb, w13b, w2b = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    want = moe_reference(xb.float(), ids, w, w13b.float(), w2b.float())
    with torch.inference_mode():
        got = moe_grouped_kernel(xb, ids, w, block(w13b), block(w2b), kernels)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=1.6e-2)


def test_experts_nobody_picked_are_never_read(kernels, block):
    x, ids, w, w13, w2 = make_layer(24, 16, 2, 64, 32, seed=5, skew=True)
    unused = sorted(set(range(16)) - set(ids.flatten().tolist()))
    assert unused
    want = moe_reference(x, ids, w, w13, w2)
    w13[unused], w2[unused] = float("nan"), float("nan")
    with torch.inference_mode():
        got = moe_grouped_kernel(x, ids, w, block(w13), block(w2), kernels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("T", "E", "inter"), [
    (6, 8, 32),  # the streaming loop
    (64, 4, 48),  # ~32 rows an expert: the library GEMM in bf16, on the paired blocks unpaired
])
def test_bfloat16(kernels, block, T, E, inter):
    x, ids, w, w13, w2 = make_layer(T, E, 2, 64, inter, seed=9)
    want = moe_reference(x, ids, w, w13, w2)
    with torch.inference_mode():
        got = moe_grouped_kernel(x.bfloat16(), ids, w, block(w13.bfloat16()),
                                 block(w2.bfloat16()), kernels)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


class Counting:
    """The real kernel module, counting its calls."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def moe_experts(self, *args):
        self.calls += 1
        return self.module.moe_experts(*args)


def test_moe_forward_takes_the_kernel_only_for_blocked_weights(kernels, block):
    x, ids, w, w13, w2 = make_layer(8, 8, 2, 64, 32, seed=3)
    spy = Counting(kernels)
    want = moe_reference(x, ids, w, w13, w2)
    with torch.inference_mode():
        plain = moe_forward(x, ids, w, w13, w2, cpu_kernels=spy)  # the checkpoint's layout: a torch path
        major = moe_forward(x, ids, w, input_major_copy(w13), input_major_copy(w2), cpu_kernels=spy)  # torch too
        assert spy.calls == 0
        ours = moe_forward(x, ids, w, block(w13), block(w2), cpu_kernels=spy)
        assert spy.calls == 1
    for got in (plain, major, ours):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_blocked_weights_without_the_kernel_are_an_error_not_garbage(kernels, block):
    x, ids, w, w13, w2 = make_layer(4, 4, 2, 64, 32, seed=4)
    with torch.inference_mode(), pytest.raises(ValueError, match="only through the CPU kernel"):
        moe_forward(x, ids, w, block(w13), block(w2))
    with torch.inference_mode(), pytest.raises(ValueError, match="or both blocked"):
        moe_forward(x, ids, w, block(w13), w2, cpu_kernels=kernels)
    with pytest.raises(ValueError, match="only through the CPU kernel"):  # autograd on: training never gets here
        moe_forward(x, ids, w, block(w13), block(w2), cpu_kernels=kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("N", "K"), [(64, 48), (70, 22), (8, 5)])
def test_block_experts_round_trips_and_pads_with_zeros(kernels, N, K, dtype):
    w = torch.randn(3, N, K).to(dtype)
    B = kernels.moe_block_columns()
    b = block_experts(w, B)
    assert blocked(b) and b.is_contiguous() and tuple(b.shape) == (3, -(-N // B), K, B)
    row = b[1, 0, 2]  # expert 1, block 0, k = 2
    if dtype == torch.float32:
        assert torch.equal(row[: min(B, N)], w[1, : min(B, N), 2])
    elif N >= B:  # bf16: columns c and c + B / 2 side by side
        assert torch.equal(row[0::2], w[1, : B // 2, 2]) and torch.equal(row[1::2], w[1, B // 2 : B, 2])
    assert torch.equal(unblock_experts(b, N), w)
    assert not unblock_experts(b, b.shape[1] * B)[:, N:].any()


def test_bad_inputs_are_refused(kernels, block):
    x, ids, w = torch.randn(3, 16), torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.rand(3, 2)
    w13b, w2b = block(torch.randn(2, 8, 16)), block(torch.randn(2, 16, 4))
    with pytest.raises(RuntimeError, match="expert id 2 is outside 0..1"):
        kernels.moe_experts(x, torch.tensor([[0, 1], [1, 2], [0, 1]]), w, w13b, w2b)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.moe_experts(x, ids, w.double(), w13b, w2b)
    for w2_bad in (torch.randn(2, 16, 40), torch.randn(3, 16, 4), torch.randn(2, 48, 4)):  # I, E, D
        with pytest.raises(RuntimeError, match="shapes differ"):
            kernels.moe_experts(x, ids, w, w13b, block(w2_bad))
    with pytest.raises(RuntimeError, match="blocked weights"):  # the plain input-major layout
        kernels.moe_experts(x, ids, w, torch.randn(2, 16, 8), torch.randn(2, 4, 16))


def test_float32_prefill_experts_run_on_onednn_where_torch_has_it(kernels):
    from kernels import cpu_pack

    assert kernels.moe_float32_gemm() == ("onednn" if cpu_pack.available(torch.float32) else "mm")


def test_the_same_bits_on_one_thread_and_on_two(kernels, block):
    x, ids, w, w13, w2 = make_layer(160, 16, 4, 128, 64, seed=21, skew=True)  # streamed and GEMM experts
    assert torch.bincount(ids.flatten()).max() > 64 and torch.bincount(ids.flatten()).min() <= 64
    w13i, w2i = block(w13), block(w2)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.inference_mode():
                outs.append(moe_grouped_kernel(x, ids, w, w13i, w2i, kernels))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], moe_reference(x, ids, w, w13, w2), atol=1e-5, rtol=1e-5)


def test_the_kernel_lets_other_python_threads_run(kernels, block):
    """A server's event loop must keep streaming while a step's experts run: the call lets go of the GIL."""
    import threading
    import time

    x, ids, w, w13, w2 = make_layer(8192, 4, 2, 512, 512, seed=4)  # one call of ~25 GFLOP
    w13i, w2i = block(w13), block(w2)
    timing: dict[str, float] = {}

    def work():
        with torch.inference_mode():
            start = time.perf_counter()
            moe_grouped_kernel(x, ids, w, w13i, w2i, kernels)
            timing["call"] = time.perf_counter() - start

    worker = threading.Thread(target=work)
    last, longest = time.perf_counter(), 0.0
    worker.start()
    while worker.is_alive():  # this thread's Python: it stalls for a whole call if the GIL is held
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    assert timing["call"] > 0.02, "too little work to tell"
    assert longest < timing["call"] / 2, f"this thread stalled {longest:.3f} s of a {timing['call']:.3f} s call"


# The float64 few-row expert kernel (csrc/moe_f64_cpu.cpp), on the checkpoint's plain weights, against the
# grouped torch path a float64 server ran before it (kernels/moe_reference.py moe_grouped_cpu).


def f64_case(T: int, E: int, K: int, D: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, D, generator=g, dtype=torch.float64) / 8
    w2 = torch.randn(E, D, inter, generator=g, dtype=torch.float64) / 8
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    weights, ids = torch.softmax(torch.randn(T, E, generator=g, dtype=torch.float64), -1).topk(K, -1)
    return x, ids.contiguous(), weights.contiguous(), w13, w2


@pytest.mark.parametrize(("E", "K", "D", "inter"), [(8, 2, 128, 128), (16, 4, 64, 24), (4, 1, 8, 8), (6, 3, 40, 56)])
@pytest.mark.parametrize("T", [1, 2, 5, 16, 40])
def test_f64_kernel_matches_the_grouped_path(kernels, E, K, D, inter, T):
    from kernels.moe_reference import moe_grouped_cpu

    x, ids, weights, w13, w2 = f64_case(T, E, K, D, inter, seed=T * E + D)
    got = kernels.moe_experts_f64(x, ids, weights, w13, w2)
    want = moe_grouped_cpu(x, ids, weights, w13, w2)
    torch.testing.assert_close(got, want, atol=1e-13 * want.abs().max().item(), rtol=1e-12)


def test_f64_kernel_rows_do_not_depend_on_the_batch(kernels):
    x, ids, weights, w13, w2 = f64_case(9, 8, 2, 128, 128, seed=4)
    together = kernels.moe_experts_f64(x, ids, weights, w13, w2)
    for t in range(9):
        alone = kernels.moe_experts_f64(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], w13, w2)
        assert torch.equal(together[t], alone[0]), t


def test_f64_kernel_refuses_what_it_cannot_take(kernels):
    x, ids, weights, w13, w2 = f64_case(3, 8, 2, 16, 16, seed=5)
    with pytest.raises(RuntimeError, match="float64 only"):
        kernels.moe_experts_f64(x.float(), ids, weights.float(), w13.float(), w2.float())
    with pytest.raises(RuntimeError, match="outside 0..7"):
        kernels.moe_experts_f64(x, torch.full_like(ids, 8), weights, w13, w2)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.moe_experts_f64(x, ids, weights, w13.transpose(1, 2).contiguous().transpose(1, 2), w2)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        kernels.moe_experts_f64(*f64_case(2, 4, 1, 12, 8, seed=6))


@pytest.mark.parametrize(("D", "inter"), [(128, 64), (544, 288)])
def test_f64_kernel_widens_narrower_weights_to_the_same_sums(kernels, D, inter):
    """The experts' weights in float32 or bfloat16 holding the same values (MXFP8's, as a float64 server
    holds them: MXFP8Tensor.narrow) give the float64 weights' result bit for bit: widened in registers for
    an expert's one or two tokens, into one float64 copy for three or more (T of 2-9 over 8 experts)."""
    from kernels import MXFP8Tensor

    x, ids, weights, w13, w2 = f64_case(9, 8, 2, D, inter, seed=7)
    q13, q2 = MXFP8Tensor.quantize(w13.float()).with_dense(torch.float64), MXFP8Tensor.quantize(w2.float()).with_dense(torch.float64)
    for T in (1, 2, 5, 9):
        want = kernels.moe_experts_f64(x[:T], ids[:T], weights[:T], q13.dense, q2.dense)
        for dtype in (torch.float32, torch.bfloat16):
            got = kernels.moe_experts_f64(x[:T], ids[:T], weights[:T], q13.dense.to(dtype), q2.dense.to(dtype))
            assert torch.equal(got, want), (T, dtype)
        with torch.inference_mode():  # as a float64 server runs it: the narrow copies
            assert torch.equal(moe_forward(x[:T], ids[:T], weights[:T], q13, q2, cpu_kernels=kernels), want), T
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.moe_experts_f64(x, ids, weights, q13.dense.float(), q2.dense)
