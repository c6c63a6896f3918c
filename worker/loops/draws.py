"""The prompt draw: which units a step samples, chosen before any rollout is paid for.

A unit is an index into a pool: a training prompt, a joint query, or an environment's reset seed. Every
rank draws the same indices from the same seeded generator (one generator per step, so a resumed step
draws what the first attempt drew) and samples its own share of them. A draw sees the rewards of the
units it drew (`observe`), which is how a draw that predicts learning signal would learn; today's draw,
uniform with replacement, learns nothing from them. Tied units are refilled by drawing again
(worker/loops/rollouts.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from worker.parallel.distributed import Ranks

T = TypeVar("T")


class PromptDraw(Protocol):
    """Which units of a pool a step samples."""

    def draw(self, rng: random.Random, n: int) -> list[int]:
        """[n] pool indices, from the step's generator `rng` (every rank alike, so every rank gets the same)."""
        ...

    def observe(self, picked: list[int], rewards: torch.Tensor) -> None:
        """The rewards [len(picked), G] of the groups of units `picked` (pool indices), as scored."""
        ...


@dataclass(frozen=True)
class Uniform:
    """Every unit alike, with replacement: the draw every kind uses today."""

    size: int  # the pool's size
    offset: int = 0  # the first index (an environment's evaluation seeds start at host.EVAL_SEEDS)

    def draw(self, rng: random.Random, n: int) -> list[int]:
        return [self.offset + rng.randrange(self.size) for _ in range(n)]

    def observe(self, picked: list[int], rewards: torch.Tensor) -> None:
        """Uniform draws ignore what they drew."""


@dataclass(frozen=True)
class Share:
    """This rank's share of one round's drawn units."""

    picked: list[int]  # [n_mine] the units' pool indices
    index: list[int]  # [n_mine] each one's place among the round's units on every rank (its seeds' key)


def draw_share(prompts: PromptDraw, rng: random.Random, n: int, ranks: Ranks) -> Share:
    """n units drawn by every rank alike; this rank's share of them."""
    drawn = prompts.draw(rng, n)
    mine = list(ranks.share(n))
    return Share(picked=[drawn[i] for i in mine], index=mine)


def pick(pool: Sequence[T], share: Share) -> list[T]:
    """The units a share names, from their pool."""
    return [pool[i] for i in share.picked]
