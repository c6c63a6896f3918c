"""A prompt's learnability: the chance that a group of its completions carries a learning signal.

GRPO learns nothing from a group whose G completions all pass or all fail: their rewards tie and every
advantage is zero. A prompt whose completions pass with probability p gives a group with a signal with
probability 1 - p^G - (1 - p)^G, largest at p = 1/2 (LILO's p(1 - p), online difficulty filtering and
MoPPS's predicted pass rates all aim at that middle). p is not known; a Beta(a, b) posterior of it,
updated with every group the prompt was drawn for (a += completions that passed, b += that failed), gives
the expected signal in closed form:

    E[p^G] = prod_{i<G} (a + i) / (a + b + i)        (the Beta's G-th moment)
    signal = 1 - E[p^G] - E[(1 - p)^G]

A prompt never drawn has the prior's: Beta(1, 1) gives 1 - 2 / (G + 1), high, so unseen prompts are drawn
(exploration without a separate rule). Pure torch, float64: a, b and the results are [n].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def beta_moment(a: torch.Tensor, b: torch.Tensor, G: int) -> torch.Tensor:
    """[n] E[p^G] for p ~ Beta(a, b)."""
    i = torch.arange(G, dtype=torch.float64)  # [G]
    a, b = a.double().unsqueeze(-1), b.double().unsqueeze(-1)  # [n, 1]
    return ((a + i) / (a + b + i)).prod(-1)


def group_signal(a: torch.Tensor, b: torch.Tensor, G: int) -> torch.Tensor:
    """[n] the chance that a group of G completions of a prompt with pass rate ~ Beta(a, b) has rewards that
    differ: 1 - E[p^G] - E[(1 - p)^G]."""
    return 1.0 - beta_moment(a, b, G) - beta_moment(b, a, G)


@dataclass(frozen=True)
class Passes:
    passed: torch.Tensor  # [n] completions at or above the threshold
    failed: torch.Tensor  # [n] scored completions below it


def passes(rewards: torch.Tensor, threshold: float) -> Passes:
    """rewards [n, k] (each unit's k completions): how many passed (at or above `threshold`) and failed; a
    NaN (a completion no reward could score) counts as neither."""
    scored = ~torch.isnan(rewards)
    passed = (rewards >= threshold) & scored
    return Passes(passed.sum(-1).double(), (scored & ~passed).sum(-1).double())
