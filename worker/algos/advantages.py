"""Group-relative advantages (GRPO, Shao et al. 2024; Dr. GRPO drops the std)."""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Advantages of `rewards` [P*G] in prompt-major order (the G completions of prompt 0 first).

    A_i = r_i - mean(group), divided by (std(group) + eps) when `normalize`; std is Bessel-corrected
    as torch.std. A group whose rewards all tie gets zero advantages. Returns [P*G].
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError("group_size must be >= 2: a group of one has no baseline")
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    if normalize:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)  # [P*G]


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool [P]: groups whose rewards all tie, so they carry no learning signal."""
    grouped = rewards.view(-1, group_size)  # [P, G]
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) == 0
