"""train.algo against hand-computed values: advantages, each aggregation, clipping, TIS, KL, masking."""

from __future__ import annotations

import math

import pytest
import torch

from train.algo import LossConfig, group_advantages, masked_mean, masked_sum, policy_loss


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    assert torch.allclose(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=tol), actual


# -- advantages ---------------------------------------------------------------------------------------------

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1])


def test_grpo_advantages_are_reward_minus_group_mean():
    close(group_advantages(REWARDS, GROUPS), [0.5, -0.5, -0.5, 0.5, 0.0, 0.0])


def test_rloo_advantages_leave_the_sample_out():
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    close(group_advantages(REWARDS, GROUPS, mode="rloo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0])
    # [3, 1, 2]: 3 - 1.5 = 1.5, 1 - 2.5 = -1.5, 2 - 2 = 0
    close(group_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([5, 5, 5]), mode="rloo"), [1.5, -1.5, 0.0])


def test_std_normalisation_divides_by_the_biased_group_std():
    close(group_advantages(REWARDS, GROUPS, std_normalize=True, eps=1e-6),
          [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6), 0.0, 0.0])
    std = math.sqrt(2 / 3)  # of [3, 1, 2] around 2, unbiased=False
    close(group_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 0, 0]), std_normalize=True),
          [1 / (std + 1e-6), -1 / (std + 1e-6), 0.0])


def test_groups_need_not_be_contiguous_or_numbered_from_zero():
    adv = group_advantages(torch.tensor([1.0, 4.0, 3.0, 0.0]), torch.tensor([7, 3, 7, 3]))
    close(adv, [-1.0, 2.0, 1.0, -2.0])


@pytest.mark.parametrize("mode", ["grpo", "rloo"])
@pytest.mark.parametrize("std", [False, True])
def test_flat_groups_and_singletons_get_exactly_zero(mode, std):
    # 0.9 three times: the float32 sum / 3 is not 0.9 again, so a plain r - mean leaves a residue.
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.7, 0.3])
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 2]), mode=mode, std_normalize=std)
    assert (adv == 0).all(), adv


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="mode"):
        group_advantages(REWARDS, GROUPS, mode="ppo")
    with pytest.raises(ValueError, match="same length"):
        group_advantages(REWARDS, GROUPS[:3])


# -- policy loss: aggregation -------------------------------------------------------------------------------

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
ADV = torch.tensor([1.0, -3.0])


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_each_aggregation_on_a_hand_computed_batch():
    # ratio 1 and w 1 everywhere, so each trained token's loss is -A: row 0 [-1, -1], row 1 [3].
    logp = [[-1.0, -2.0, -0.5], [-0.3, -1.0, -1.0]]
    expected = {"token_sum": 1 / 6, "token_mean": 1 / 3, "seq_mean": (-1 + 3) / 2}
    grads = {"token_sum": [[-1 / 6, -1 / 6, 0], [3 / 6, 0, 0]],
             "token_mean": [[-1 / 3, -1 / 3, 0], [1, 0, 0]],
             "seq_mean": [[-1 / 4, -1 / 4, 0], [3 / 2, 0, 0]]}
    for agg, value in expected.items():
        x = leaf(logp)
        cfg = LossConfig(aggregation=agg, normalizer=6.0 if agg == "token_sum" else None)
        loss, metrics = policy_loss(x, x.detach(), ADV, MASK, cfg)
        assert loss.item() == pytest.approx(value), agg
        loss.backward()
        close(x.grad, grads[agg])
        assert metrics["tokens"] == 3 and metrics["ratio_mean"] == pytest.approx(1.0)


def test_ratio_and_importance_weight_multiply_in():
    old = torch.zeros(1, 2)
    x = leaf([[math.log(1.1), 0.0]])
    sampler = torch.tensor([[-math.log(1.5), 0.0]])  # exp(old - sampler) = 1.5, within the cap
    loss, m = policy_loss(x, sampler, torch.tensor([2.0]), torch.ones(1, 2), LossConfig(aggregation="token_mean"),
                          old_logprobs_BT=old)
    # token 0: -1.5 * 1.1 * 2; token 1: -1 * 1 * 2
    assert loss.item() == pytest.approx((-3.3 - 2.0) / 2)
    assert m["is_weight_mean"] == pytest.approx(1.25) and m["is_weight_max"] == pytest.approx(1.5)
    assert m["ratio_mean"] == pytest.approx(1.05)


def test_seq_mean_skips_sequences_without_trained_tokens():
    x = leaf([[0.0, 0.0], [0.0, 0.0]])
    loss, _ = policy_loss(x, x.detach(), torch.tensor([1.0, 5.0]), torch.tensor([[1, 1], [0, 0]]),
                          LossConfig(aggregation="seq_mean"))
    assert loss.item() == pytest.approx(-1.0)


# -- clipping, truncation ------------------------------------------------------------------------------------

def test_clip_high_binds_positive_advantages_and_clip_low_negative_ones():
    ratios = [1.5, 0.5, 0.5, 1.5, 1.25, 0.75]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0])
    x = leaf([[math.log(r)] for r in ratios])
    loss, m = policy_loss(x, torch.zeros(6, 1), adv, torch.ones(6, 1), LossConfig(normalizer=1.0),
                          old_logprobs_BT=torch.zeros(6, 1))
    # per token -min(r*A, clip(r, 0.8, 1.28)*A): -1.28, -0.5, 0.8, 1.5, -1.25, 0.8
    assert loss.item() == pytest.approx(-1.28 - 0.5 + 0.8 + 1.5 - 1.25 + 0.8)
    loss.backward()
    # Clipped tokens get no gradient; the others -A * ratio. 1.25 (A > 0) is inside clip-higher's range,
    # 0.75 (A < 0) is below 1 - clip_low: the asymmetry.
    close(x.grad, [[0.0], [-0.5], [0.0], [1.5], [-1.25], [0.0]])
    assert m["clip_frac"] == pytest.approx(3 / 6)


def test_truncated_importance_weight():
    x = leaf([[0.0, 0.0]])
    sampler = torch.tensor([[-math.log(5.0), 0.0]])  # exp(old - sampler) = 5 on token 0
    loss, m = policy_loss(x, sampler, torch.tensor([1.0]), torch.ones(1, 2), LossConfig(normalizer=1.0))
    assert loss.item() == pytest.approx(-2.0 - 1.0)  # weight truncated to tis_cap = 2
    loss.backward()
    close(x.grad, [[-2.0, -1.0]])
    assert m["is_weight_max"] == pytest.approx(5.0) and m["is_weight_mean"] == pytest.approx(3.0)
    assert m["is_truncated_frac"] == pytest.approx(0.5)
    loss, _ = policy_loss(leaf([[0.0, 0.0]]), sampler, torch.tensor([1.0]), torch.ones(1, 2),
                          LossConfig(normalizer=1.0, tis_cap=None))
    assert loss.item() == pytest.approx(-2.0)  # correction off: w = 1


# -- masking, zero advantage ---------------------------------------------------------------------------------

@pytest.mark.parametrize("agg", ["token_sum", "token_mean", "seq_mean"])
def test_masked_positions_with_inf_logprobs_give_no_nan(agg):
    x = leaf([[-0.5, -math.inf, -math.inf], [-1e30, -0.2, math.nan]])
    mask = torch.tensor([[1, 0, 0], [0, 1, 0]])
    sampler = torch.tensor([[-0.5, 1e30, -math.inf], [math.inf, -0.3, -math.inf]])
    ref = torch.tensor([[-0.4, -math.inf, 0.0], [-math.inf, -0.2, math.nan]])
    cfg = LossConfig(aggregation=agg, normalizer=4.0, kl_coef=0.1)
    loss, m = policy_loss(x, sampler, torch.tensor([1.0, -1.0]), mask, cfg,
                          old_logprobs_BT=torch.tensor([[-0.5, -math.inf, 3.0], [0.0, -0.2, 0.0]]),
                          ref_logprobs_BT=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all(), (loss, x.grad)
    assert (x.grad[~mask.bool()] == 0).all() and (x.grad[mask.bool()] != 0).all()
    assert all(math.isfinite(v) for v in m.values()), m


@pytest.mark.parametrize("agg", ["token_sum", "token_mean", "seq_mean"])
def test_zero_advantage_gives_exactly_zero_gradient(agg):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 7, generator=g) - 2).requires_grad_()
    old = x.detach() + 0.3 * torch.randn(4, 7, generator=g)  # ratios away from 1, some clipped
    sampler = old + 0.5 * torch.randn(4, 7, generator=g)
    mask = (torch.rand(4, 7, generator=g) > 0.3).int()
    loss, _ = policy_loss(x, sampler, torch.zeros(4), mask, LossConfig(aggregation=agg, normalizer=28.0),
                          old_logprobs_BT=old)
    loss.backward()
    assert loss.item() == 0.0 and (x.grad == 0).all()


def test_negative_weight_scales_only_the_negative_advantages():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 5, generator=g) - 2
    mask = torch.ones(3, 5, dtype=torch.int)
    adv = torch.tensor([1.0, -0.5, -2.0])
    grads = {}
    for w in (1.0, 0.25, 0.0):
        x = base.clone().requires_grad_()
        loss, _ = policy_loss(x, base, adv, mask, LossConfig(aggregation="token_sum", normalizer=15.0,
                                                             negative_weight=w))
        loss.backward()
        grads[w] = x.grad
    assert torch.equal(grads[0.25][0], grads[1.0][0]) and torch.equal(grads[0.0][0], grads[1.0][0])
    assert torch.allclose(grads[0.25][1:], 0.25 * grads[1.0][1:]) and (grads[0.0][1:] == 0).all()
    assert (grads[1.0][1:] != 0).all()
    with pytest.raises(ValueError, match="negative_weight"):
        LossConfig(negative_weight=1.5)


# -- KL ------------------------------------------------------------------------------------------------------

def test_k1_and_k3_by_hand():
    logp, ref = math.log(0.5), math.log(0.25)
    k1 = logp - ref  # log 2
    k3 = math.exp(ref - logp) - (ref - logp) - 1  # 0.5 + log 2 - 1
    for est, kl in (("k1", k1), ("k3", k3)):
        x = leaf([[logp]])
        cfg = LossConfig(normalizer=1.0, kl_coef=0.5, kl_estimator=est)
        loss, m = policy_loss(x, x.detach(), torch.zeros(1), torch.ones(1, 1), cfg,
                              ref_logprobs_BT=torch.tensor([[ref]]))
        assert m["kl_mean"] == pytest.approx(kl) and loss.item() == pytest.approx(0.5 * kl)
    assert k3 == pytest.approx(0.193147, abs=1e-6)


# -- validation ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"advantage": "ppo"}, "advantage"),
    ({"aggregation": "mean"}, "aggregation"),
    ({"kl_estimator": "k2"}, "kl_estimator"),
    ({"normalizer": 0.0}, "normalizer"),
    ({"clip_low": 1.0}, "clip_low"),
    ({"clip_high": -0.1}, "clip_high"),
    ({"tis_cap": 0.0}, "tis_cap"),
    ({"kl_coef": -1.0}, "kl_coef"),
    ({"eps": 0.0}, "eps"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


def test_policy_loss_rejects_missing_inputs():
    x, ones = leaf([[0.0]]), torch.ones(1, 1)
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(x, x.detach(), torch.ones(1), ones, LossConfig())
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, x.detach(), torch.ones(1), ones, LossConfig(normalizer=1.0, kl_coef=0.1))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x.detach(), torch.ones(2), ones, LossConfig(normalizer=1.0))
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x.detach(), torch.ones(1), torch.ones(1, 2), LossConfig(normalizer=1.0))


def test_masked_helpers():
    x = torch.tensor([[1.0, math.inf], [3.0, math.nan]])
    mask = torch.tensor([[1, 0], [1, 0]])
    assert masked_sum(x, mask).item() == 4.0 and masked_mean(x, mask).item() == 2.0
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0
