"""The prompt draw: which units a step samples, chosen before any rollout is paid for.

A unit is an index into a pool: a training prompt, a joint query, or an environment's reset seed. Every
rank draws the same indices from the same seeded generator (one generator per step, so a resumed step
draws what the first attempt drew) and samples its own share of them. A draw sees the rewards of the
units it drew (`observe`): `Uniform` learns nothing from them; `Learnability` (`selection.prompts:
learnability`) keeps a posterior of each unit's pass rate and draws by the predicted chance of a group
with a learning signal. Tied units are refilled by drawing again (worker/loops/rollouts.py).
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from worker.algos.learnability import group_signal, passes
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

    def predicted(self, picked: list[int]) -> float | None:
        """The share of the groups of `picked` predicted to have a learning signal (None: no prediction)."""
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

    def predicted(self, picked: list[int]) -> float | None:
        return None


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


@dataclass
class Learnability:
    """Units drawn in proportion to their predicted learning signal (worker/algos/learnability.py), each at
    least `floor`, with replacement: a Beta(1, 1) prior per unit, updated by every group drawn for it. A
    unit never drawn has the prior's signal, so the pool's unseen units share one weight and one is drawn
    uniformly among them. Deterministic for the step's generator and the state; the state (the posteriors
    of the units seen) goes into the checkpoint."""

    size: int  # the pool's size
    group_size: int  # G: completions a group holds
    threshold: float  # a completion whose reward is at or above this passed
    floor: float  # the least weight of a unit
    offset: int = 0
    seen: dict[int, tuple[float, float]] = field(default_factory=dict)  # unit -> its posterior's (a, b)

    def weights(self, units: list[int]) -> list[float]:
        """Each unit's draw weight: its predicted signal, at least the floor."""
        return group_signal(*self._ab(units), self.group_size).clamp(min=self.floor).tolist()

    def predicted(self, picked: list[int]) -> float:
        """The share of groups of `picked` predicted to have a signal, before they are sampled."""
        units = [u - self.offset for u in picked]
        return float(group_signal(*self._ab(units), self.group_size).mean()) if units else 0.0

    def _ab(self, units: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """[n] a and [n] b of the units' posteriors (the prior's for a unit never drawn)."""
        ab = [self.seen.get(u, (1.0, 1.0)) for u in units]
        return torch.tensor([x for x, _ in ab]), torch.tensor([y for _, y in ab])

    def draw(self, rng: random.Random, n: int) -> list[int]:
        known = sorted(self.seen)
        w_known = self.weights(known)
        w_unseen = self.weights([-1])[0]  # the prior's
        unseen_mass = (self.size - len(known)) * w_unseen
        cum = list(itertools.accumulate(w_known))
        total = unseen_mass + (cum[-1] if cum else 0.0)
        out = []
        for _ in range(n):
            u = rng.random() * total
            if u < unseen_mass:
                out.append(self._unseen(rng))
            else:
                out.append(known[min(bisect.bisect_right(cum, u - unseen_mass), len(known) - 1)])
        return [self.offset + u for u in out]

    def _unseen(self, rng: random.Random) -> int:
        """A unit never drawn, uniformly: by redrawing while the pool is mostly unseen, else from the list."""
        if len(self.seen) * 2 < self.size:
            while (u := rng.randrange(self.size)) in self.seen:
                pass
            return u
        rest = [u for u in range(self.size) if u not in self.seen]
        return rest[rng.randrange(len(rest))]

    def observe(self, picked: list[int], rewards: torch.Tensor) -> None:
        counted = passes(rewards, self.threshold)
        for unit, up, down in zip(picked, counted.passed.tolist(), counted.failed.tolist()):
            a, b = self.seen.get(unit - self.offset, (1.0, 1.0))
            self.seen[unit - self.offset] = (a + up, b + down)

    def state_dict(self) -> dict[str, list[list[float]]]:
        return {"seen": [[u, a, b] for u, (a, b) in sorted(self.seen.items())]}

    def load_state_dict(self, state: dict[str, list[list[float]]]) -> None:
        self.seen = {int(u): (a, b) for u, a, b in state["seen"]}
