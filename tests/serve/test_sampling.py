"""The batched, counter-based sampler (serve/engine/sampling.py): right distribution, filters kept, and a
seeded row's pick independent of the batch it is drawn in."""

from __future__ import annotations

import pytest
import torch

from kernels.op_count import OpCounter
from serve.engine.base import SamplingParams
from serve.engine.sampling import (
    RowParams,
    argmax_rows,
    exponential_noise,
    hash_noise,
    make_generator,
    sample,
    sample_batch,
    sample_rows,
)


def draw_many(logits_V: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    stream = make_generator(params)
    counts = torch.zeros(logits_V.numel())
    for _ in range(n):
        counts[sample(logits_V, params, stream)[0]] += 1
    return counts / n


def test_draws_follow_the_softmax_at_the_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 1.5])
    got = draw_many(logits, SamplingParams(max_tokens=1, temperature=0.7, seed=3), 6000)
    want = torch.softmax(logits / 0.7, -1)
    assert (got - want).abs().max() < 0.025, (got, want)


def test_top_k_and_top_p_keep_only_their_tokens():
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -2.0])
    top_k = draw_many(logits, SamplingParams(max_tokens=1, temperature=1.0, top_k=2, seed=1), 2000)
    assert top_k[2:].sum() == 0 and top_k[:2].min() > 0.3
    p = torch.softmax(logits, -1)  # 0.50, 0.30, 0.18, ...: top_p 0.6 keeps the first two
    top_p = draw_many(logits, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.6, seed=1), 2000)
    assert top_p[2:].sum() == 0
    assert top_p[0] == pytest.approx(float(p[0] / p[:2].sum()), abs=0.04)


def test_a_seeded_row_draws_the_same_alone_or_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    params = [SamplingParams(max_tokens=1, temperature=1.0, seed=s, top_p=0.95) for s in range(5)]
    batch = [[sample_batch(logits, params, [make_generator(p) for p in params])[i][0] for i in range(5)]]
    alone = [sample(logits[i], params[i], make_generator(params[i]))[0] for i in range(5)]
    reversed_ = sample_batch(logits.flip(0), params[::-1], [make_generator(p) for p in params[::-1]])
    assert batch[0] == alone == [t for t, _, _ in reversed_][::-1]


def test_the_stream_moves_on_and_seeds_differ():
    logits = torch.zeros(1000)
    p = SamplingParams(max_tokens=1, temperature=1.0, seed=42)
    s = make_generator(p)
    picks = [sample(logits, p, s)[0] for _ in range(20)]
    assert len(set(picks)) > 15 and s.draws == 20
    again = make_generator(p)
    assert [sample(logits, p, again)[0] for _ in range(20)] == picks
    other = make_generator(SamplingParams(max_tokens=1, temperature=1.0, seed=43))
    assert [sample(logits, p, other)[0] for _ in range(20)] != picks


def test_noise_is_exponential():
    seeds = torch.tensor([[1, 0], [2**32 - 1, 2**32 - 1]], dtype=torch.int64)
    for noise_fn in (exponential_noise, hash_noise):  # the CPU's and the GPU's
        noise = noise_fn(seeds, torch.tensor([0, 7]), 50_000)
        assert noise.min() > 0
        assert noise.mean(-1).sub(1).abs().max() < 0.02 and noise.std(-1).sub(1).abs().max() < 0.03
        assert not torch.equal(noise, noise_fn(seeds, torch.tensor([1, 7]), 50_000))  # a new draw, new noise


def test_greedy_rows_in_a_sampled_batch_take_the_argmax_and_nan_rows_fail_alone():
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    logits[2] = float("nan")
    params = [SamplingParams(max_tokens=1, temperature=0.0, logprobs=True),
              SamplingParams(max_tokens=1, temperature=1.0, seed=1), SamplingParams(max_tokens=1, temperature=1.0)]
    picks = sample_batch(logits, params, [make_generator(p) for p in params])
    assert picks[0][0] == int(logits[0].argmax())
    assert picks[0][1] == pytest.approx(float(torch.log_softmax(logits[0], -1).max()))
    assert isinstance(picks[1], tuple) and isinstance(picks[2], RuntimeError)


def test_the_host_argmax_and_bad_rows_agree_with_torchs():
    """The host path's numpy argmax picks what torch.argmax picks (the first of tied maxima, a row's first
    NaN), rows laid out either way; `bad` flags a NaN anywhere in a row and a row that allows nothing."""
    torch.manual_seed(2)
    x = torch.randn(6, 300).round(decimals=1)  # ties among the maxima
    x[1, [7, 200]] = 9.0
    x[2, [5, 250]] = float("nan")
    x[3] = float("-inf")
    x[4, 299] = float("inf")
    for rows in (x, x.T.contiguous().T, x.double()):
        assert torch.equal(argmax_rows(rows, host=True), torch.argmax(rows, -1))
    allowed = x.clone()
    allowed[5] = float("-inf")  # a grammar that allows nothing in row 5
    *_, bad = sample_rows(x, allowed, None, sampled=False, filtered=False, top_n=0, host=True)
    assert bad.tolist() == [False, False, True, True, False, True]


def test_sample_rows_never_waits_on_the_host():
    logits = torch.randn(4, 64)
    rows = RowParams(torch.tensor([0.0, 0.5, 1.0, 2.0]), torch.tensor([0, 5, 0, 3]), torch.tensor([1.0, 0.9, 0.8, 1.0]),
                     torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]]), torch.tensor([0, 1, 2, 3]))
    with OpCounter(strict=True):
        ids, lp, top_ids, top_lp, bad = sample_rows(logits, logits, rows, sampled=True, filtered=True, top_n=5)
    assert ids.shape == (4,) and top_ids.shape == (4, 5) and not bad.any()
