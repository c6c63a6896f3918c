"""Scoring a round's groups: the job's reward functions, or the rewards an environment's episodes earned.

A completion nothing could score (every counted reward raised, or its environment failed with
`on_error: drop_group`) is excluded: it takes its group's mean reward, so it has zero advantage and moves
no baseline, and it is left out of the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.core.specs import EnvironmentSpec
from worker import rewards
from worker.datasets import Example
from worker.environments.episodes import Episode
from worker.environments.runner import episode_rewards
from worker.loops.setup import RLJob, Setup
from worker.rewards import Scored


@dataclass(frozen=True)
class GroupRewards:
    """A round's completions, scored."""

    rewards: torch.Tensor  # [N]; an excluded completion holds its group's mean
    excluded: torch.Tensor  # bool [N]: a counted reward could not score it
    scored: Scored  # every entry's scores, and the time they took


def score_groups(s: Setup[RLJob], completions: list[str], examples: list[Example], G: int, step: int) -> GroupRewards:
    """Rewards [N] and an exclusion mask [N] (True: a counted reward could not score it)."""
    items = [rewards.Item(ex.question, c, tuple(ex.answers)) for ex, c in
             zip((ex for ex in examples for _ in range(G)), completions, strict=True)]
    scored = s.scorer.score(items, step=step)  # failures become the job's warning event (setup.warn_reward_failures)
    return with_exclusions(scored, G)


def with_exclusions(scored: Scored, G: int) -> GroupRewards:
    """Rewards whose NaN entries (nothing could score them) are excluded and take their group's mean:
    zero advantage, no effect on the baseline."""
    r = torch.tensor(scored.total, dtype=torch.float32)
    excluded = torch.isnan(r)
    if excluded.any():
        grouped = r.view(-1, G)
        means = torch.nanmean(grouped, dim=1, keepdim=True).nan_to_num(0.0).expand_as(grouped)
        r = torch.where(torch.isnan(grouped), means, grouped).reshape(-1)
    return GroupRewards(rewards=r, excluded=excluded, scored=scored)


def episode_scores(env: EnvironmentSpec, episodes: list[Episode], G: int) -> GroupRewards:
    """The environment's rewards of a draw's episodes [N]: with environment.on_error `drop_group`, every
    episode of a group the environment failed in is excluded; with `zero`, a failed episode keeps what it
    earned (0 if nothing)."""
    r = episode_rewards(episodes, env.reward)
    if env.on_error == "drop_group":
        failed = torch.tensor([e.error is not None for e in episodes]).view(-1, G).any(1)  # [n_groups]
        r = torch.where(failed.repeat_interleave(G), torch.full_like(r, float("nan")), r)
    return with_exclusions(Scored(total=r.tolist(), per_fn={}, failures=[]), G)  # its time is time/env_s
