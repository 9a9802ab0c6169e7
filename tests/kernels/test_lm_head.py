"""The LM head and log-softmax in vocabulary slices (kernels/lm_head.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.lm_head import chunked_logprobs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_values_and_gradients_equal_the_whole_vocabulary(dtype, tol):
    g = torch.Generator().manual_seed(0)
    N, D, V = 37, 24, 1000
    h = (torch.randn(N, D, generator=g) * 2).to(dtype).requires_grad_()
    w = torch.randn(V, D, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[:3] = torch.tensor([0, V - 1, 300])  # first and last row of the vocabulary, a slice boundary
    upstream = torch.randn(N, generator=g)
    lp = chunked_logprobs(h, w, targets, 300)  # 300 does not divide 1000: a short last slice
    lp.backward(upstream)
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.log_softmax(F.linear(h2, w2).float(), -1).gather(1, targets[:, None]).squeeze(1)
    ref.backward(upstream)
    assert lp.dtype == ref.dtype == torch.float32  # as the trainer's log-probs always are
    assert (lp - ref).abs().max() < 1e-6 * ref.abs().max() * (100 if dtype == torch.bfloat16 else 1)
    for a, b in ((h.grad, h2.grad), (w.grad, w2.grad)):
        assert a.dtype == b.dtype
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()) < tol


PEAK = """
import sys, torch, torch.nn.functional as F
from pathlib import Path
from kernels.lm_head import chunked_logprobs
torch.set_num_threads(1)
N, D = 1024, 64
def kib(field):
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith(field + ":"))
def peak(V, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.1).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    before = kib("VmRSS")
    if chunk:
        lp = chunked_logprobs(h, w, t, chunk)
    else:
        lp = F.log_softmax(F.linear(h, w), -1).gather(1, t[:, None]).squeeze(1)
    lp.sum().backward()
    return (kib("VmHWM") - before) * 1024
peak(512, 128), peak(512, 0)  # warm-up: both paths' one-time allocations before anything is measured
for arg in sys.argv[1:]:
    print(peak(*map(int, arg.split(":"))))
"""


def _peak_bytes(*runs: tuple[int, int]) -> list[int]:
    """Peak resident growth of each (vocabulary, chunk) run, measured one after another in one process (the
    high-water mark reset before each, every tensor of a run freed before the next): one torch start-up, not
    one per run (~3 s each on 2 cores)."""
    # every allocation above 64 KiB its own mapping, returned on free: resident memory is live memory
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", PEAK, *(f"{v}:{c}" for v, c in runs)], capture_output=True,
                         text=True, cwd=ROOT, timeout=300, check=True, env=env)
    return [int(x) for x in out.stdout.split()[-len(runs):]]


def test_peak_memory_does_not_grow_with_the_vocabulary():
    """Peak resident memory of the loss's forward and backward, 1,024 tokens, vocabulary 16k vs 128k: in
    slices of 4,096 it grows by the head's weight and its gradient only; the whole-vocabulary version
    (the measure's control) grows by the [N, V] float32 tensors it holds."""
    small, large = 16384, 131072
    weights_growth = 2 * (large - small) * 64 * 4  # w and its gradient
    chunked_large, chunked_small, whole_large, whole_small = _peak_bytes((large, 4096), (small, 4096), (large, 0),
                                                                         (small, 0))
    chunked, whole = chunked_large - chunked_small, whole_large - whole_small
    per_chunk = 1024 * 4096 * 4
    assert chunked < weights_growth + 2 * per_chunk, (chunked, weights_growth)
    assert whole > weights_growth + 2 * 1024 * (large - small) * 4, whole  # the control grows with V
    print(json.dumps({"chunked_growth_mib": chunked / 2**20, "whole_growth_mib": whole / 2**20}))
