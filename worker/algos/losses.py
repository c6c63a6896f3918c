"""The GRPO-Clip objective and its GSPO and CISPO variants, + k3 KL, with three token aggregations.

Each variant is a small function from (logp, old_logp, advantages, mask) to a per-token surrogate;
`SURROGATES` names them:
  grpo:  -min(r A, clip(r, 1-eps_low, 1+eps_high) A), r = pi/pi_old per token (DeepSeekMath);
  gspo:  the same with the sequence's length-normalised ratio s = exp(mean_t log r), one value
         broadcast to every token of the sequence (Zheng et al. 2025, "GSPO"); with seq_mean it is
         exactly GSPO's sequence objective;
  cispo: -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi: a REINFORCE term whose importance weight is
         clipped and carries no gradient, so clipped tokens still train (MiniMax-M1, "CISPO").
An optional `weights` [B, T] (the rollout correction, worker/algos/correction.py) multiplies each
token's surrogate; it carries no gradient.

One definition: `sample_losses` gives each sample's share of the batch loss, divided by a
`Normaliser` fixed for the whole batch, so shares from any split into micro-batches (or any
subset, as TracIn selects) add up to the whole batch's loss. `policy_loss` is their sum.

Shapes: B sequences (completions), T completion tokens (right-padded, `mask` marks real ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from service.core.loss_names import LossAgg, LossName

Agg = LossAgg  # grpo.loss_agg
AGGREGATIONS: tuple[Agg, ...] = get_args(LossAgg)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask is 1 (0 when there are none)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman 2020): exp(d) - d - 1, d = ref - logp.

    Non-negative, unbiased under samples from pi. [B, T] -> [B, T].
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical over the last dim: logsumexp(l) - sum(softmax(l) * l). [..., V] -> [...]."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


@dataclass(frozen=True)
class Normaliser:
    """What a batch's loss is divided by, fixed for the whole batch (never a micro-batch's own).

    token_mean: sum over every real token / the batch's real tokens;
    seq_mean: mean over sequences of each sequence's token mean;
    dr_grpo: sum / (sequences * T), a constant with no length bias (Dr. GRPO).
    """

    agg: Agg
    tokens: float  # real tokens in the whole batch
    sequences: int  # sequences in the whole batch
    max_len: int  # padded completion length T

    @classmethod
    def of(cls, mask: torch.Tensor, agg: Agg) -> Normaliser:
        """The normaliser of the batch whose loss mask is `mask` [B, T]."""
        if agg not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {agg!r}: one of {', '.join(AGGREGATIONS)}")
        return cls(agg, float(mask.sum()), int(mask.shape[0]), int(mask.shape[1]))

    def shares(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each sequence's share of the aggregate. per_token, mask: [B, T] -> [B]."""
        mask = mask.to(per_token.dtype)
        summed = (per_token * mask).sum(1)  # [B]
        if self.agg == "token_mean":
            return summed / max(self.tokens, 1.0)
        if self.agg == "seq_mean":
            return summed / mask.sum(1).clamp(min=1.0) / max(self.sequences, 1)
        return summed / max(self.sequences * self.max_len, 1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: Agg) -> torch.Tensor:
    """The aggregate of a whole batch: the sum of its sequences' shares. [B, T] -> []."""
    return Normaliser.of(mask, agg).shares(per_token, mask).sum()


@dataclass
class TokenStats:
    """Sums over real tokens, so micro-batches add up: ratio mean = ratio_sum / tokens."""

    tokens: float = 0.0
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    clipped: float = 0.0  # tokens where min() took the clipped branch

    def __iadd__(self, other: TokenStats) -> TokenStats:
        self.tokens += other.tokens
        self.ratio_sum += other.ratio_sum
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        self.clipped += other.clipped
        return self

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {"ratio/mean": self.ratio_sum / n, "ratio/max": self.ratio_max,
                "clip_ratio/region_mean": self.clipped / n}


@dataclass
class SampleLosses:
    """Per-sample shares of the batch loss: `loss.sum()` over the whole batch is its loss."""

    loss: torch.Tensor  # [B] surrogate + kl_coef * KL shares, with grad
    policy: torch.Tensor  # [B] the surrogate's shares, detached
    kl: torch.Tensor | None  # [B] the KL's shares (before kl_coef), detached; None without a reference
    tokens: TokenStats


@dataclass(frozen=True)
class Surrogate:
    """A variant's per-token surrogate [B, T] (to be minimised), the ratio its statistics report
    [B, T], and where its clip changed the value [B, T] bool."""

    per_token: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor


def grpo_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, lo: float, hi: float) -> Surrogate:
    """Token-level clipped surrogate. logp, old_logp, mask: [B, T]; adv: [B, 1]."""
    ratio = torch.exp(logp - old_logp)  # [B, T]
    unclipped, clipped = ratio * adv, torch.clamp(ratio, lo, hi) * adv  # [B, T]
    return Surrogate(-torch.minimum(unclipped, clipped), ratio, clipped < unclipped)


def gspo_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, lo: float, hi: float) -> Surrogate:
    """Sequence-level clipped surrogate on s = exp(mean over real tokens of log r), broadcast [B, T]."""
    log_s = masked_mean(logp - old_logp, mask, dim=1)  # [B]
    s = torch.exp(log_s).unsqueeze(1).expand_as(logp)  # [B, T]
    unclipped, clipped = s * adv, torch.clamp(s, lo, hi) * adv  # [B, T]
    return Surrogate(-torch.minimum(unclipped, clipped), s, clipped < unclipped)


def cispo_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, lo: float, hi: float) -> Surrogate:
    """REINFORCE with a clipped, stop-gradient importance weight: -sg(clip(r)) A log pi. [B, T]."""
    ratio = torch.exp(logp - old_logp)  # [B, T]
    weight = torch.clamp(ratio, lo, hi).detach()  # [B, T]
    return Surrogate(-weight * adv * logp, ratio, weight != ratio.detach())


SURROGATES = {"grpo": grpo_surrogate, "gspo": gspo_surrogate, "cispo": cispo_surrogate}


def sample_losses(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    norm: Normaliser,
    *,
    ref_logp: torch.Tensor | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.0,
    loss: LossName = "grpo",
    weights: torch.Tensor | None = None,
) -> SampleLosses:
    """Per sample: the `loss` variant's surrogate (times `weights` when given) + kl_coef * k3(pi, pi_ref),
    each sample's tokens divided by the batch's `norm`.

    logp, old_logp, ref_logp, mask, weights: [B, T]; advantages: [B]. With ref_logp the KL is
    measured whatever kl_coef is (0 only leaves it out of the loss).
    """
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1]
    sur = SURROGATES[loss](logp, old_logp, adv, mask, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = sur.per_token if weights is None else sur.per_token * weights.to(logp.dtype).detach()  # [B, T]
    policy = norm.shares(per_token, mask)  # [B]
    total, kl = policy, None
    if ref_logp is not None:
        kl = norm.shares(k3_kl(logp, ref_logp), mask)  # [B]
        if kl_coef:
            total = policy + kl_coef * kl
    with torch.no_grad():
        real, ratios = mask.bool(), sur.ratio.detach()
        stats = TokenStats(tokens=float(mask.sum()), ratio_sum=float((ratios * mask).sum()),
                           ratio_max=float(torch.where(real, ratios, torch.zeros_like(ratios)).max()) if real.any() else 0.0,
                           clipped=float((sur.clipped & real).sum()))
    return SampleLosses(total, policy.detach(), None if kl is None else kl.detach(), stats)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.0,
    agg: Agg = "token_mean",
    loss: LossName = "grpo",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of a whole batch (the sum of its `sample_losses`) and its statistics: loss/policy,
    kl (only with a reference), ratio mean/max, clip fraction."""
    parts = sample_losses(logp, old_logp, advantages, mask, Normaliser.of(mask, agg), ref_logp=ref_logp,
                          clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, kl_coef=kl_coef,
                          loss=loss, weights=weights)
    stats = {"loss/policy": float(parts.policy.sum()), **parts.tokens.metrics()}
    if parts.kl is not None:
        stats["kl"] = float(parts.kl.sum())
    return parts.loss.sum(), stats
