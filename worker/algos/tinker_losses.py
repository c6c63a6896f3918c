"""The tinker SDK's built-in losses (`forward_backward(loss_fn=...)`), on one datum's tokens.

As the SDK's documentation defines them: every loss is a *sum* over the datum's tokens (no
normalisation; a loop that wants a mean scales its weights or advantages), and `forward_backward`
sums it over the data. Names: `logp` [N] the trained policy's log-prob of each target token
(with gradient), `q` [N] the sampler's log-prob of the same token (the `logprobs` input),
`adv` [N] per-token advantages, ratio r = exp(logp - q).
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.algos.losses import cispo_surrogate, grpo_surrogate


def cross_entropy(logp: Tensor, *, weights: Tensor) -> Tensor:
    """-sum_t w_t * logp_t: supervised learning, w = 0 on prompt tokens."""
    return -(weights * logp).sum()


def importance_sampling(logp: Tensor, *, q: Tensor, adv: Tensor) -> Tensor:
    """-sum_t r_t * A_t: REINFORCE corrected for the sampler being another policy."""
    return -(torch.exp(logp - q) * adv).sum()


def ppo(logp: Tensor, *, q: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """-sum_t min(r_t A_t, clip(r_t, lo, hi) A_t), per token; lo and hi bound the ratio itself: the
    GRPO loop's token-level surrogate, summed."""
    return grpo_surrogate(logp, q, adv, torch.ones_like(logp), clip_low, clip_high).per_token.sum()


def cispo(logp: Tensor, *, q: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """-sum_t sg(clip(r_t, lo, hi)) * logp_t * A_t: the clipped ratio weighs, never blocks, a gradient
    (the GRPO loop's CISPO surrogate, summed)."""
    return cispo_surrogate(logp, q, adv, torch.ones_like(logp), clip_low, clip_high).per_token.sum()


def dro(logp: Tensor, *, q: Tensor, adv: Tensor, beta: float) -> Tensor:
    """-sum_t (logp_t A_t - beta/2 (logp_t - q_t)^2): a quadratic pull towards the sampler."""
    return -(logp * adv - 0.5 * beta * (logp - q) ** 2).sum()


def gspo(logp: Tensor, *, q: Tensor, adv: Tensor, clip_low: float, clip_high: float,
         sequence_mask: Tensor | None = None) -> Tensor:
    """GSPO-token: every token carries the sequence ratio s = exp(mean_{t in M} (logp_t - q_t))
    as its value and its own log-prob's gradient, s_t = sg(s) * exp(logp_t - sg(logp_t)); then
    PPO's clipped surrogate on s_t. M: the tokens `sequence_mask` marks (all when None)."""
    in_ratio = torch.ones_like(logp, dtype=torch.bool) if sequence_mask is None else sequence_mask != 0
    if not bool(in_ratio.any()):  # no token defines the ratio: it is 1
        log_s = torch.zeros((), dtype=logp.dtype)
    else:
        log_s = (logp.detach() - q)[in_ratio].mean()
    ratio = torch.exp(log_s + logp - logp.detach())  # [N]: value s, gradient of each logp_t
    return -torch.minimum(ratio * adv, ratio.clamp(clip_low, clip_high) * adv).sum()
