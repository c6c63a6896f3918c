"""The GRPO-Clip objective: clipped surrogate + k3 KL, with three token aggregations.

Shapes: B sequences (completions), T completion tokens (right-padded, `mask` marks real ones).
"""

from __future__ import annotations

from typing import Literal

import torch

Agg = Literal["token_mean", "seq_mean", "dr_grpo"]


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


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: Agg) -> torch.Tensor:
    """token_mean: sum / n_tokens; seq_mean: mean over sequences of their token means;
    dr_grpo: sum / (B * T), a constant normaliser with no length bias."""
    mask = mask.to(per_token.dtype)
    if agg == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if agg == "seq_mean":
        return masked_mean(per_token, mask, dim=1).mean()
    if agg == "dr_grpo":
        return (per_token * mask).sum() / (mask.shape[0] * mask.shape[1])
    raise ValueError(f"unknown aggregation {agg!r}")


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Clip loss: -min(r A, clip(r, 1-eps_low, 1+eps_high) A) + kl_coef * k3(pi, pi_ref).

    logp, old_logp, ref_logp, mask: [B, T]; advantages: [B]. Returns the scalar loss and detached
    stats: policy loss, kl, ratio mean/max, clip fraction (tokens where the clipped branch is taken).
    """
    mask = mask.to(logp.dtype)
    ratios = torch.exp(logp - old_logp)  # [B, T]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1]
    unclipped = ratios * adv  # [B, T]
    clipped = torch.clamp(ratios, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv  # [B, T]
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    pg_loss = aggregate(per_token, mask, agg)
    loss = pg_loss
    kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        kl_tok = k3_kl(logp, ref_logp)  # [B, T]
        kl = aggregate(kl_tok, mask, agg)
        loss = loss + kl_coef * kl
    with torch.no_grad():
        clipped_taken = (clipped < unclipped).to(logp.dtype)  # where min picked the clipped branch
        n = mask.sum().clamp(min=1.0)
        stats = {
            "loss/policy": pg_loss.detach(),
            "kl": kl.detach(),
            "ratio/mean": (ratios * mask).sum() / n,
            "ratio/max": torch.where(mask.bool(), ratios, torch.zeros_like(ratios)).max(),
            "clip_ratio/region_mean": (clipped_taken * mask).sum() / n,
        }
    return loss, stats


def per_sample_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    batch_tokens: float,
    batch_size: int,
    ref_logp: torch.Tensor | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.0,
    agg: Agg = "token_mean",
) -> torch.Tensor:
    """Each sample's share of the aggregated GRPO-Clip loss, so that over the whole batch the shares
    sum to `policy_loss` (batch_tokens / batch_size describe the whole batch, not this micro-batch).
    Returns [B]; the gradient of share i is sample i's gradient, as TracIn needs."""
    mask = mask.to(logp.dtype)
    ratios = torch.exp(logp - old_logp)  # [B, T]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1]
    per_token = -torch.minimum(ratios * adv, torch.clamp(ratios, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv)
    if ref_logp is not None and kl_coef:
        per_token = per_token + kl_coef * k3_kl(logp, ref_logp)
    summed = (per_token * mask).sum(1)  # [B]
    if agg == "token_mean":
        return summed / max(batch_tokens, 1.0)
    if agg == "seq_mean":
        return summed / mask.sum(1).clamp(min=1.0) / batch_size
    if agg == "dr_grpo":
        return summed / (batch_size * mask.shape[1])
    raise ValueError(f"unknown aggregation {agg!r}")
