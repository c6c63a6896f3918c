"""Which training samples to keep. Pure torch.

Every policy returns a bool mask [N]. `scores` [N] are TracIn inner products <grad L_i, grad L_val>:
a positive score means a gradient step on sample i lowers the validation loss (to first order).
The baselines (random, pass_rate, all) use no influence, so a job running them pays none of its cost.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def positive(scores: torch.Tensor) -> torch.Tensor:
    """Keep the samples that help validation (score > 0), as the method describes."""
    return scores > 0


def top_fraction(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep the ceil(fraction * N) highest-scoring samples."""
    k = max(1, math.ceil(fraction * scores.numel()))
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[torch.topk(scores, k).indices] = True
    return mask


def top_cosine(scores: torch.Tensor, sq_norms: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep the ceil(fraction * N) samples whose gradient points most along the validation gradient:
    cos(g_i, G_val) = score_i / (|g_i| |G_val|), ranked by score_i / |g_i| (|G_val| is the same for all).
    sq_norms: [N] |g_i|^2; a zero gradient (a zero-advantage sample) has cosine 0."""
    norms = sq_norms.clamp(min=0).sqrt().to(scores.dtype)
    cos = torch.where(norms > 0, scores / norms.clamp(min=torch.finfo(norms.dtype).tiny), torch.zeros_like(scores))
    return top_fraction(cos, fraction)


def pass_rate(correct: torch.Tensor, group_size: int, fraction: float) -> torch.Tensor:
    """Keep whole groups, those whose share of correct answers is nearest 50% first (where GRPO's
    advantages are largest), until ceil(fraction * N) samples are kept. correct: [N] 0/1, group-major."""
    n = correct.numel()
    rate = correct.double().reshape(-1, group_size).mean(1)  # [groups]
    order = sorted(range(rate.numel()), key=lambda g: (abs(float(rate[g]) - 0.5), g))
    mask = torch.zeros(n, dtype=torch.bool)
    for g in order:
        if int(mask.sum()) >= max(1, math.ceil(fraction * n)):
            break
        mask[g * group_size:(g + 1) * group_size] = True
    return mask


def random_subset(n: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random ceil(fraction * N) subset: the baseline TracIn is compared with."""
    k = max(1, math.ceil(fraction * n))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=generator)[:k]] = True
    return mask


def greedy(scores: torch.Tensor, gram: torch.Tensor, fraction: float, eta: float) -> torch.Tensor:
    """GREATS-style greedy selection: repeatedly add the sample with the largest marginal gain
    <g_i, g_val> - eta * sum_{j in S} <g_i, g_j> (the interaction with what is already selected,
    under an identity-curvature approximation), up to ceil(fraction * N) samples and only while
    the gain is positive. gram: [N, N] inner products of the training gradients."""
    n = scores.numel()
    k = max(1, math.ceil(fraction * n))
    mask = torch.zeros(n, dtype=torch.bool)
    interaction = torch.zeros(n, dtype=scores.dtype)
    for _ in range(k):
        gain = scores - eta * interaction
        gain[mask] = -math.inf
        best = int(torch.argmax(gain))
        if gain[best] <= 0:
            break
        mask[best] = True
        interaction += gram[:, best].to(scores.dtype)
    return mask


def histogram(scores: torch.Tensor, bins: int = 20) -> dict[str, Any]:
    lo, hi = float(scores.min()), float(scores.max())
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    counts = torch.histc(scores.double(), bins=bins, min=lo, max=hi)
    edges = torch.linspace(lo, hi, bins + 1)
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}
