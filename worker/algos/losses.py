"""The GRPO-Clip objective: clipped surrogate + k3 KL, with three token aggregations.

One definition: `sample_losses` gives each sample's share of the batch loss, divided by a
`Normaliser` fixed for the whole batch, so shares from any split into micro-batches (or any
subset, as TracIn selects) add up to the whole batch's loss. `policy_loss` is their sum.

Shapes: B sequences (completions), T completion tokens (right-padded, `mask` marks real ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Agg = Literal["token_mean", "seq_mean", "dr_grpo"]
AGGREGATIONS: tuple[Agg, ...] = ("token_mean", "seq_mean", "dr_grpo")


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
    def of(cls, mask: torch.Tensor, agg: Agg) -> "Normaliser":
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

    def __iadd__(self, other: "TokenStats") -> "TokenStats":
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
) -> SampleLosses:
    """GRPO-Clip per sample: -min(r A, clip(r, 1-eps_low, 1+eps_high) A) + kl_coef * k3(pi, pi_ref),
    each sample's tokens divided by the batch's `norm`.

    logp, old_logp, ref_logp, mask: [B, T]; advantages: [B]. With ref_logp the KL is measured
    whatever kl_coef is (0 only leaves it out of the loss).
    """
    mask = mask.to(logp.dtype)
    ratios = torch.exp(logp - old_logp)  # [B, T]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1]
    unclipped = ratios * adv  # [B, T]
    clipped = torch.clamp(ratios, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv  # [B, T]
    policy = norm.shares(-torch.minimum(unclipped, clipped), mask)  # [B]
    loss, kl = policy, None
    if ref_logp is not None:
        kl = norm.shares(k3_kl(logp, ref_logp), mask)  # [B]
        if kl_coef:
            loss = policy + kl_coef * kl
    with torch.no_grad():
        real = mask.bool()
        stats = TokenStats(tokens=float(mask.sum()), ratio_sum=float((ratios * mask).sum()),
                           ratio_max=float(torch.where(real, ratios, torch.zeros_like(ratios)).max()) if real.any() else 0.0,
                           clipped=float(((clipped < unclipped) & real).sum()))
    return SampleLosses(loss, policy.detach(), None if kl is None else kl.detach(), stats)


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of a whole batch (the sum of its `sample_losses`) and its statistics: loss/policy,
    kl (only with a reference), ratio mean/max, clip fraction."""
    parts = sample_losses(logp, old_logp, advantages, mask, Normaliser.of(mask, agg), ref_logp=ref_logp,
                          clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, kl_coef=kl_coef)
    stats = {"loss/policy": float(parts.policy.sum()), **parts.tokens.metrics()}
    if parts.kl is not None:
        stats["kl"] = float(parts.kl.sum())
    return parts.loss.sum(), stats
