"""Drawing a token from each row's distribution by inverting its CDF with one uniform of the row's own.

`torch.multinomial` draws a single sample by the exponential race: one exponential variate per
vocabulary entry, 49,152 of them per row and token for SmolLM2, which took a fifth of the Hugging Face
sampler's time (1.1 of 5.2 s for 32 rows x 24 tokens). Inverting the CDF needs one uniform per row: the
per-row generators (a row's draws depend on its seed only) then cost 32 scalar draws a token, and the
rest is one batched cumulative sum and search.

The CDF is summed in float64: in float32 a token of probability under ~1e-8 adds nothing to a running
sum near 1 and could never be drawn; in float64 the mass lost that way is below 1e-12 per row.
"""

from __future__ import annotations

import torch


def uniforms(gens: list[torch.Generator], device: torch.device | str) -> torch.Tensor:
    """u [B] float64 in [0, 1): one draw from each row's generator."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=device) for g in gens])


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token [B] whose CDF interval holds u: index i with cdf[i-1] <= u * total < cdf[i].

    probs [B, V] non-negative, each row with positive total (unnormalised is fine: u is scaled by the
    row's total); u [B] in [0, 1). A token of probability 0 has an empty interval and is never drawn.
    """
    cdf = probs.to(torch.float64).cumsum(-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    # u * total < total in exact arithmetic; rounding could reach it and run past the last token with mass
    x = torch.minimum(u[:, None].to(cdf.device) * total, torch.nextafter(total, torch.zeros_like(total)))  # [B, 1]
    return torch.searchsorted(cdf, x, right=True)[:, 0]  # [B]
