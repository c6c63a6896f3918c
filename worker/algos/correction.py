"""The train/inference mismatch of an engine's samples, and its importance-sampling correction.

An inference engine samples with other kernels (and often another precision) than the trainer, so
its log-prob of a token, logq, differs from the trainer's, logp_old, under the same weights. A loop
that treats engine samples as on-policy optimises a biased objective; the correction re-weights each
token (or sequence) by the ratio rho = pi_old / q (computed from logp_old - logq):

  truncated:  w = min(rho, C)                      (truncated IS; verl, TRL "truncate")
  masked:     w = rho where 1/C <= rho <= C, else 0   (masked IS: the outliers are dropped)

at `token` level (rho per token) or `sequence` level (rho = product over the sequence's tokens,
one weight for all of them). The weight carries no gradient and multiplies the surrogate; the
surrogate's own ratio keeps pi_old in its denominator, so the clip still sees exactly 1 before the
first update.

Shapes: B sequences, T completion tokens (right-padded; `mask` marks real ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Mode = Literal["none", "truncated", "masked"]
Level = Literal["token", "sequence"]


@dataclass(frozen=True)
class Correction:
    weights: torch.Tensor | None  # [B, T] the loss's per-token weight; None with mode "none"
    log_ratio: torch.Tensor  # [B, T] logp_old - logq at real tokens (0 elsewhere)
    changed: torch.Tensor  # [B, T] bool: real tokens whose weight the cap truncated or masked


def correct(logp_old: torch.Tensor, logq: torch.Tensor, mask: torch.Tensor, *, mode: Mode, level: Level,
            cap: float) -> Correction:
    """The correction weights of samples drawn from q and trained under pi_old. [B, T] each."""
    real = mask.bool()
    log_ratio = torch.where(real, logp_old.double() - logq.double(), 0.0)  # [B, T]
    if level == "sequence":
        log_ratio_at = log_ratio.sum(1, keepdim=True).expand_as(log_ratio)  # [B, T]: the sequence's, everywhere
    else:
        log_ratio_at = log_ratio
    rho = torch.exp(log_ratio_at.clamp(max=80.0))  # [B, T]; exp(80) is finite in float64 and far above any cap
    if mode == "none":
        return Correction(None, log_ratio, torch.zeros_like(real))
    if mode == "truncated":
        changed = real & (rho > cap)
        w = rho.clamp(max=cap)
    elif mode == "masked":
        changed = real & ((rho > cap) | (rho < 1.0 / cap))
        w = torch.where(changed, 0.0, rho)
    else:
        raise ValueError(f"unknown correction {mode!r}: one of none, truncated, masked")
    return Correction(torch.where(real, w, 0.0).to(logp_old.dtype), log_ratio, changed)


@dataclass
class MismatchStats:
    """Sums over real tokens, so micro-batches and ranks add up; the quantiles come from the log-ratios
    kept, one float per real token."""

    tokens: float = 0.0
    abs_sum: float = 0.0
    abs_max: float = 0.0
    changed: float = 0.0
    log_ratios: list[torch.Tensor] | None = None

    def add(self, c: Correction, mask: torch.Tensor) -> None:
        real = mask.bool()
        d = c.log_ratio[real].abs()  # [M]
        self.tokens += float(real.sum())
        self.abs_sum += float(d.sum())
        self.abs_max = max(self.abs_max, float(d.max()) if d.numel() else 0.0)
        self.changed += float(c.changed.sum())
        self.log_ratios = (self.log_ratios or []) + [c.log_ratio[real].float().cpu()]

    def ratios(self) -> torch.Tensor:
        """The log-ratios kept, as one tensor [M]."""
        return torch.cat(self.log_ratios or [torch.zeros(0)])

    def metrics(self, all_log_ratios: torch.Tensor) -> dict[str, float]:
        """The step's metrics, given every rank's log-ratios [M] (this rank's alone with one process)."""
        n = max(self.tokens, 1.0)
        out = {"mismatch/logp_abs_mean": self.abs_sum / n, "mismatch/logp_abs_max": self.abs_max,
               "correction/changed_fraction": self.changed / n}
        if all_log_ratios.numel():
            q = torch.quantile(torch.exp(all_log_ratios.double()), torch.tensor([0.05, 0.5, 0.95], dtype=torch.double))
            out.update({"mismatch/ratio_p05": float(q[0]), "mismatch/ratio_p50": float(q[1]),
                        "mismatch/ratio_p95": float(q[2])})
        return out
