"""A job's `rewards` entries as one Scorer: functions, models and remote graders side by side.

Its own module so that scoring.py, which the models and the remote grader build on, imports none of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.core.reward_specs import FunctionReward, RewardSpec
from worker.rewards.functions import lookup
from worker.rewards.models import build as model_reward
from worker.rewards.remote import HttpGrader
from worker.rewards.scoring import Component, FunctionComponent, OnFailures, Scorer, with_diagnostics


def build_scorer(entries: Sequence[RewardSpec], *, settings, device: str, job_id: int | None,
                 on_failures: OnFailures | None = None) -> Scorer:
    """The components of a job's `rewards` entries; models are loaded once, frozen, on `device`."""
    components: list[Component] = []
    for e in entries:
        if isinstance(e, FunctionReward):
            components.append(FunctionComponent(e.key, e.weight, lookup(e.name).fn))
        elif e.name == "http":
            components.append(HttpGrader(e, settings=settings, job_id=job_id))
        else:
            components.append(model_reward(e, settings=settings, device=device))
    return Scorer(with_diagnostics(components, [e.name for e in entries if isinstance(e, FunctionReward)]),
                  on_failures)
