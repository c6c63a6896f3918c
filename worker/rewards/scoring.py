"""Scoring a batch of completions with a job's weighted rewards.

Each `rewards` entry becomes a component that scores a whole batch of items at once (a function
one item at a time; a model in batches; a remote grader in requests). A component that cannot
score an item returns None for it, and a component that raises loses the whole batch: either way
those completions are excluded from the loss (their group's mean reward, zero advantage) and a
warning event says why. The job goes on, unless a component raises `RewardUnavailable`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from worker.rewards.functions import lookup


@dataclass(frozen=True)
class Item:
    """What a reward sees of one completion."""

    prompt: str  # the task's question (without the chat template or a retrieved document)
    completion: str
    answers: tuple[str, ...]  # the acceptable references

    @property
    def answer(self) -> str:
        return self.answers[0] if self.answers else ""


@dataclass(frozen=True)
class RewardFailure:
    index: int  # the completion's position in the scored batch (-1: the whole batch)
    reward: str  # the entry's key
    error: str  # "ExceptionType: message"


@dataclass
class Scores:
    """One component's scores of a batch: None where it could not score."""

    values: list[float | None]
    failures: list[RewardFailure] = field(default_factory=list)


class RewardUnavailable(RuntimeError):
    """A reward that can no longer score at all (past its failure limit): the job fails."""


class Component(Protocol):
    key: str  # names the metric reward/<key>/mean
    weight: float
    counts: bool  # False: a diagnostic, logged but neither trained on nor excluding

    def score(self, items: Sequence[Item], step: int) -> Scores: ...


@dataclass
class FunctionComponent:
    """A reward function of (completion, answers), one item at a time."""

    key: str
    weight: float
    fn: Callable[[str, Sequence[str]], float]
    counts: bool = True

    def score(self, items: Sequence[Item], step: int) -> Scores:
        out = Scores([])
        for i, it in enumerate(items):
            try:
                out.values.append(float(self.fn(it.completion, it.answers)))
            except Exception as exc:  # one bad completion must not kill the job
                out.values.append(None)
                out.failures.append(RewardFailure(i, self.key, f"{type(exc).__name__}: {exc}"))
        return out


@dataclass
class Scored:
    total: list[float]  # weighted sum per completion; NaN where a counted reward could not score
    per_fn: dict[str, list[float]]  # each entry's raw value (NaN: none), diagnostics included
    failures: list[RewardFailure]
    seconds: float = 0.0  # wall time of the scoring


OnFailures = Callable[[list[RewardFailure], int], None]  # (failures, step): the job's warning event


class Scorer:
    """A job's rewards, built once per job; `score` is called for every batch of completions."""

    def __init__(self, components: list[Component], on_failures: OnFailures | None = None) -> None:
        self.components = components
        self.on_failures = on_failures

    def score(self, items: Sequence[Item], *, step: int) -> Scored:
        t0 = time.perf_counter()
        per_fn: dict[str, list[float]] = {}
        failures: list[RewardFailure] = []
        total = [0.0] * len(items)
        for c in self.components:
            try:
                got = c.score(items, step)
            except RewardUnavailable:
                raise
            except Exception as exc:  # the whole batch, for this reward
                got = Scores([None] * len(items), [RewardFailure(-1, c.key, f"{type(exc).__name__}: {exc}")])
            if len(got.values) != len(items):
                got = Scores([None] * len(items), [RewardFailure(-1, c.key, f"returned {len(got.values)} scores "
                                                                            f"for {len(items)} completions")])
            failures += got.failures
            values = []
            for i, v in enumerate(got.values):
                if v is not None and not math.isfinite(v):
                    failures.append(RewardFailure(i, c.key, f"ValueError: returned {v}"))
                    v = None
                values.append(math.nan if v is None else v)
                if c.counts:
                    total[i] += c.weight * values[-1]
            per_fn[c.key] = values
        if failures and self.on_failures is not None:
            self.on_failures(failures, step)
        return Scored(total, per_fn, failures, time.perf_counter() - t0)


def with_diagnostics(components: list[Component], function_names: list[str]) -> list[Component]:
    """Add the diagnostics that functions log alongside (r1_math: its format credit), unless an
    entry of that name is trained on already."""
    keys = {c.key for c in components}
    for name in function_names:
        for d in lookup(name).diagnostics:
            if d not in keys:
                components.append(FunctionComponent(d, 0.0, lookup(d).fn, counts=False))
                keys.add(d)
    return components


def score(completions: Sequence[str], answers: Sequence[Sequence[str]], weights: dict[str, float]) -> Scored:
    """Score completions with weighted reward functions (no prompts needed)."""
    components: list[Component] = [FunctionComponent(n, w, lookup(n).fn) for n, w in weights.items()]
    items = [Item("", c, tuple(a)) for c, a in zip(completions, answers, strict=True)]
    return Scorer(with_diagnostics(components, list(weights))).score(items, step=0)
