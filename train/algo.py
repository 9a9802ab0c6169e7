"""The RL objective as pure functions: group advantages and a clipped, importance-corrected policy loss.

Approach. Rollouts are sampled in groups (several attempts at the same task); each sample's advantage
is its reward relative to its group (GRPO: minus the group mean; RLOO: minus the mean of the *other*
members), optionally divided by the group's std (GRPO's original; off by default, as Dr.GRPO argues it
biases towards too-easy/too-hard groups). The loss per sampled token is PPO's clipped surrogate with
DAPO's asymmetric "clip-higher" range, multiplied by a truncated importance weight that corrects for
the rollouts coming from the inference server rather than from the trainer:

    ratio = exp(logp - old)                                   current vs. proximal (start of step)
    w     = min(exp(old - sampler), tis_cap)                  detached; staleness + numerics mismatch
    loss  = w * -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) + kl_coef * kl

and is aggregated over the trained tokens (mask = 1) as Dr.GRPO/DeepSWE ("token_sum", a constant normaliser),
DAPO ("token_mean") or the original GRPO ("seq_mean").

Limits. Each call normalises over the batch it is given: "token_mean" and "seq_mean" are therefore
not exact under gradient accumulation over micro-batches (each micro-batch gets its own denominator);
"token_sum" with a normaliser fixed for the whole step is. Everything is computed in float32 whatever
the input dtype, since exp() of bf16 log-prob differences is too coarse for ratios near 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ADVANTAGES = ("grpo", "rloo")
AGGREGATIONS = ("token_sum", "token_mean", "seq_mean")
KL_ESTIMATORS = ("k1", "k3")


@dataclass
class LossConfig:
    advantage: str = "grpo"
    """"grpo": reward minus the group mean; "rloo": reward minus the mean of the other group members."""
    std_normalize: bool = False
    """Divide advantages by the group's std + eps (GRPO's original); off as Dr.GRPO recommends."""
    aggregation: str = "token_sum"
    """"token_sum": sum over all trained tokens / `normalizer` (Dr.GRPO, DeepSWE); "token_mean": / number
    of trained tokens in the batch (DAPO); "seq_mean": mean per sequence, then over sequences (GRPO)."""
    normalizer: float | None = None
    """The constant divisor of "token_sum", typically sequences per step x max_new_tokens. Required by
    policy_loss when aggregation is "token_sum" (the caller knows it; there is no safe default)."""
    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low (binds for negative advantages)."""
    clip_high: float = 0.28
    """The ratio is clipped above at 1 + clip_high (binds for positive advantages; DAPO's clip-higher
    keeps low-probability tokens learnable)."""
    tis_cap: float | None = 2.0
    """Truncation of the importance weight exp(old - sampler); None disables the correction (w = 1)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against a reference policy; 0 = no KL, no reference log-probs needed."""
    kl_estimator: str = "k3"
    """"k1": logp - ref (unbiased, high variance, can be negative); "k3": exp(ref - logp) - (ref - logp)
    - 1 (unbiased, non-negative, lower variance)."""
    eps: float = 1e-6
    """Added to the group std before dividing, so near-constant groups do not explode."""
    negative_weight: float = 1.0
    """Negative advantages are multiplied by this (1 = the plain policy gradient). Below 1 the step
    leans on raising what passed rather than pushing down what failed, whose freed probability a small
    model spreads over other tokens; 0 keeps only the better-than-average episodes."""

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {ADVANTAGES}, got {self.advantage!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.normalizer is not None and not self.normalizer > 0:
            raise ValueError(f"normalizer must be > 0 (or None), got {self.normalizer}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0 (or None to disable), got {self.tis_cap}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not 0 <= self.negative_weight <= 1:
            raise ValueError(f"negative_weight must be in [0, 1], got {self.negative_weight}")


def masked_sum(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Sum of x over mask; masked entries may hold inf/NaN (torch.where keeps them out of the graph)."""
    return torch.where(mask_BT.bool(), x_BT, torch.zeros_like(x_BT)).sum()


def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of x over mask; 0 when the mask is empty (rather than NaN)."""
    return masked_sum(x_BT, mask_BT) / mask_BT.bool().sum().clamp(min=1)


def group_advantages(rewards_N: Tensor, group_ids_N: Tensor, mode: str = "grpo", std_normalize: bool = False,
                     eps: float = 1e-6) -> Tensor:
    """Per-sample advantages relative to the sample's group (same group id = rollouts of one task).

    GRPO: r_i - mean(group). RLOO: r_i - mean(others) = n/(n-1) * (r_i - mean); a group of one gets 0.
    With std_normalize, divided by the group's (biased) std + eps. A group whose rewards are all equal
    gets exactly 0 (not a rounding residue), so it contributes no gradient at all.
    """
    if mode not in ADVANTAGES:
        raise ValueError(f"mode must be one of {ADVANTAGES}, got {mode!r}")
    if rewards_N.dim() != 1 or group_ids_N.shape != rewards_N.shape:
        raise ValueError(f"rewards and group ids must be 1-D of the same length, got "
                         f"{tuple(rewards_N.shape)} and {tuple(group_ids_N.shape)}")
    r_N = rewards_N if rewards_N.is_floating_point() else rewards_N.float()
    _, inv_N = torch.unique(group_ids_N, return_inverse=True)
    G = int(inv_N.max().item()) + 1 if inv_N.numel() else 0
    count_G = torch.bincount(inv_N, minlength=G).to(r_N.dtype)
    mean_G = torch.zeros(G, dtype=r_N.dtype, device=r_N.device).index_add_(0, inv_N, r_N) / count_G
    centred_N = r_N - mean_G[inv_N]
    # Sum/count of equal floats need not round back to the value itself; flat groups are forced to 0.
    max_G = torch.full((G,), -torch.inf, dtype=r_N.dtype, device=r_N.device).scatter_reduce(0, inv_N, r_N, "amax")
    min_G = torch.full((G,), torch.inf, dtype=r_N.dtype, device=r_N.device).scatter_reduce(0, inv_N, r_N, "amin")
    flat_N = (max_G == min_G)[inv_N]
    adv_N = centred_N
    if mode == "rloo":
        n_N = count_G[inv_N]
        adv_N = centred_N * n_N / (n_N - 1).clamp(min=1)
    if std_normalize:
        var_G = torch.zeros_like(mean_G).index_add_(0, inv_N, centred_N**2) / count_G
        adv_N = adv_N / (var_G.sqrt()[inv_N] + eps)
    return torch.where(flat_N, torch.zeros_like(adv_N), adv_N)


def _kl_BT(logp_BT: Tensor, ref_BT: Tensor, estimator: str) -> Tensor:
    if estimator == "k1":
        return logp_BT - ref_BT
    d_BT = ref_BT - logp_BT
    return torch.exp(d_BT) - d_BT - 1


def policy_loss(logprobs_BT: Tensor, sampler_logprobs_BT: Tensor, advantages_B: Tensor, mask_BT: Tensor,
                cfg: LossConfig, old_logprobs_BT: Tensor | None = None,
                ref_logprobs_BT: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The scalar loss for one batch, and metrics (floats) for logging.

    logprobs_BT: the trainer's current log-probs of the sampled tokens (requires grad).
    sampler_logprobs_BT: those the inference server reported when sampling (the behaviour policy).
    old_logprobs_BT: the trainer's log-probs at the start of this step (proximal policy); default
        logprobs_BT.detach(), i.e. one gradient step per batch (ratio 1).
    ref_logprobs_BT: reference policy, required when cfg.kl_coef > 0.
    mask_BT: 1 on tokens to train on (sampled by the model), 0 on prompt, tool output and padding.
    Masked-out positions may hold any value, -inf included: they contribute neither loss nor gradient.
    """
    B, T = logprobs_BT.shape
    for name, t in (("sampler_logprobs", sampler_logprobs_BT), ("mask", mask_BT),
                    ("old_logprobs", old_logprobs_BT), ("ref_logprobs", ref_logprobs_BT)):
        if t is not None and t.shape != (B, T):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(B, T)} like logprobs")
    if advantages_B.shape != (B,):
        raise ValueError(f"advantages has shape {tuple(advantages_B.shape)}, expected {(B,)}")
    if cfg.aggregation == "token_sum" and cfg.normalizer is None:
        raise ValueError("aggregation 'token_sum' needs cfg.normalizer (e.g. sequences per step x "
                         "max_new_tokens); set it, or use 'token_mean'")
    if cfg.kl_coef > 0 and ref_logprobs_BT is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs_BT")

    m_BT = mask_BT.bool()
    zero_BT = torch.zeros((B, T), dtype=torch.float32, device=logprobs_BT.device)

    def masked(x_BT: Tensor) -> Tensor:
        # Every input is zeroed off the mask first, so -inf/NaN there never meets exp() or a product
        # (0 * inf = NaN would otherwise leak into the loss or, worse, only into the backward pass).
        return torch.where(m_BT, x_BT.float(), zero_BT)

    logp_BT = masked(logprobs_BT)
    old_BT = logp_BT.detach() if old_logprobs_BT is None else masked(old_logprobs_BT.detach())
    sampler_BT = masked(sampler_logprobs_BT.detach())

    ratio_BT = torch.exp(logp_BT - old_BT)
    adv_B1 = advantages_B.float().detach()[:, None]
    if cfg.negative_weight != 1.0:
        adv_B1 = torch.where(adv_B1 < 0, adv_B1 * cfg.negative_weight, adv_B1)
    clipped_BT = ratio_BT.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg_BT = -torch.minimum(ratio_BT * adv_B1, clipped_BT * adv_B1)

    is_raw_BT = torch.exp(old_BT - sampler_BT)
    w_BT = torch.ones_like(is_raw_BT) if cfg.tis_cap is None else is_raw_BT.clamp(max=cfg.tis_cap)
    loss_BT = w_BT * pg_BT

    kl_BT = None
    if cfg.kl_coef > 0:
        kl_BT = _kl_BT(logp_BT, masked(ref_logprobs_BT.detach()), cfg.kl_estimator)
        loss_BT = loss_BT + cfg.kl_coef * kl_BT

    n_tokens = int(m_BT.sum().item())
    if cfg.aggregation == "token_sum":
        loss = masked_sum(loss_BT, m_BT) / cfg.normalizer
    elif cfg.aggregation == "token_mean":
        loss = masked_mean(loss_BT, m_BT)
    else:
        count_B = m_BT.sum(dim=1)
        seq_B = torch.where(m_BT, loss_BT, zero_BT).sum(dim=1) / count_B.clamp(min=1)
        has_B = count_B > 0
        # Sequences with no trainable token are left out rather than counted as zero-loss sequences.
        loss = torch.where(has_B, seq_B, torch.zeros_like(seq_B)).sum() / has_B.sum().clamp(min=1)

    with torch.no_grad():
        # Clipping is "active" where the clipped branch won and so the token's gradient is zero.
        clip_BT = ((adv_B1 > 0) & (ratio_BT > 1 + cfg.clip_high)) | ((adv_B1 < 0) & (ratio_BT < 1 - cfg.clip_low))
        metrics = {
            "ratio_mean": masked_mean(ratio_BT, m_BT).item(),
            "clip_frac": masked_mean(clip_BT.float(), m_BT).item(),
            "is_weight_mean": masked_mean(is_raw_BT, m_BT).item(),
            "is_weight_max": torch.where(m_BT, is_raw_BT, zero_BT).max().item() if n_tokens else 0.0,
            "is_truncated_frac": (masked_mean((is_raw_BT > cfg.tis_cap).float(), m_BT).item()
                                  if cfg.tis_cap is not None else 0.0),
            "tokens": float(n_tokens),
        }
        if kl_BT is not None:
            metrics["kl_mean"] = masked_mean(kl_BT, m_BT).item()
    return loss, metrics
