"""Health guards: what a step's metrics say about whether the run can learn.

A GRPO run can succeed and learn nothing: every group's rewards tie (no advantage, a zero
gradient), the policy's entropy collapses, completions all hit the token budget, the importance
ratio leaves its band, or scoring takes the whole step. Each guard reads one value per step,
compares it with a warn and a critical threshold (the spec's `health` section), and reports a
level: ok (green), warn (amber) or critical (red). A change of level is a `health` event; the
API's job record carries each guard's latest (`summarise`), and a guard the spec names in
`health.stop_on` ends the job at red. A non-finite loss or gradient is always red and always
ends the job, before the optimizer applies it.

Pure logic on floats: the worker feeds it metrics, the API reads its events; no torch here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import Field, model_validator

from service.core.spec_base import _Section

Level = Literal["ok", "warn", "critical"]
LEVELS: tuple[Level, ...] = ("ok", "warn", "critical")
GuardName = Literal["informative_groups", "entropy", "truncation", "ratio", "grader_time", "environment", "update",
                    "non_finite"]
EVENT = "health"  # the event type every guard's change of level is recorded as
EVENT_LEVEL = {"ok": "info", "warn": "warning", "critical": "error"}
# A guard gets worse at once, and better only after this many steps in a row in a better band: a value
# at the edge of a band (2 prompts' groups: 0, 0.5 or 1 informative) would otherwise flag every step.
RECOVER_STEPS = 3


class Band(_Section):
    """A guard's thresholds: at or past `warn` it is amber, at or past `critical` red."""

    warn: float = Field(description="Amber at or past this value.")
    critical: float = Field(description="Red at or past this value.")


@dataclass(frozen=True)
class Guard:
    """One guard: its name, what it reads, and which way is bad."""

    name: GuardName
    worse: Literal["low", "high"]  # the direction in which the value gets worse
    doc: str


GUARDS: tuple[Guard, ...] = (
    Guard("informative_groups", "low", "share of the step's groups whose rewards differ (1 - frac_reward_zero_std): "
          "a group that ties carries no advantage"),
    Guard("entropy", "low", "policy entropy per token, over the first measured step's: a collapse means the "
          "policy stopped exploring"),
    Guard("truncation", "high", "share of completions cut at max_new_tokens (completions/clipped_ratio)"),
    Guard("ratio", "high", "largest importance ratio of a step's tokens (ratio/max): past the clip band the "
          "update is off-policy"),
    Guard("grader_time", "high", "share of the step's wall time spent scoring rewards (time/reward_s over time/step_s)"),
    Guard("environment", "high", "share of the step's training episodes the environment failed (env/error_ratio): "
          "a failed episode earns nothing and teaches nothing"),
    Guard("update", "high", "consecutive steps whose update was zero (a zero gradient, or a skipped step)"),
    Guard("non_finite", "high", "a NaN or infinite loss or gradient: the job stops before the optimizer applies it"),
)
BY_NAME = {g.name: g for g in GUARDS}


class HealthSpec(_Section):
    """Thresholds of the health guards, and which of them stop the job."""

    informative_groups: Band = Field(default_factory=lambda: Band(warn=0.5, critical=0.0),
                                     description="Share of groups whose rewards differ: amber at or below warn, red at "
                                     "or below critical (0: every group tied).")
    entropy: Band = Field(default_factory=lambda: Band(warn=0.25, critical=0.1),
                          description="Entropy per token as a share of the first measured step's: amber at or below "
                          "warn, red at or below critical.")
    truncation: Band = Field(default_factory=lambda: Band(warn=0.5, critical=0.9),
                             description="Share of completions cut at max_new_tokens: amber at or above warn, red at or "
                             "above critical.")
    ratio: Band = Field(default_factory=lambda: Band(warn=2.0, critical=10.0),
                        description="Largest importance ratio of a step's tokens: amber at or above warn, red at or "
                        "above critical.")
    grader_time: Band = Field(default_factory=lambda: Band(warn=0.5, critical=0.8),
                              description="Share of a step's time spent scoring: amber at or above warn, red at or "
                              "above critical.")
    environment: Band = Field(default_factory=lambda: Band(warn=0.1, critical=0.5),
                              description="Share of a step's training episodes the environment failed (timed out, "
                              "errored, closed the session): amber at or above warn, red at or above critical.")
    update: Band = Field(default_factory=lambda: Band(warn=1, critical=3),
                         description="Consecutive steps with a zero update: amber at or above warn, red at or above "
                         "critical.")
    stop_on: list[GuardName] = Field(default_factory=list, description="Guards whose red ends the job as failed, with "
                                     "a checkpoint of the step (a non-finite loss or gradient always ends it, with "
                                     "the last checkpoint before it).")

    @model_validator(mode="after")
    def _ordered(self) -> HealthSpec:
        for g in GUARDS:
            band = getattr(self, g.name, None)
            if band is None:
                continue
            if g.worse == "low" and band.critical > band.warn:
                raise ValueError(f"health.{g.name}: critical ({band.critical}) must be at or below warn ({band.warn}): "
                                 "lower values are worse")
            if g.worse == "high" and band.critical < band.warn:
                raise ValueError(f"health.{g.name}: critical ({band.critical}) must be at or above warn ({band.warn}): "
                                 "higher values are worse")
        return self


def level_of(guard: Guard, value: float, band: Band) -> Level:
    def past(threshold: float) -> bool:
        return value <= threshold if guard.worse == "low" else value >= threshold

    return "critical" if past(band.critical) else "warn" if past(band.warn) else "ok"


@dataclass(frozen=True)
class HealthFlag:
    """A guard's level from a step on: what a `health` event carries."""

    guard: GuardName
    level: Level
    step: int | None
    value: float | None
    threshold: float | None  # the threshold it is at or past (None: back to ok)
    message: str

    def event_data(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepHealth:
    """One step's reading: the values as metrics, the guards whose level changed, and the flag that
    stops the job (a red guard of `health.stop_on`), if any."""

    metrics: dict[str, float]
    changes: list[HealthFlag]
    stop: HealthFlag | None = None


def _message(guard: Guard, level: Level, value: float, threshold: float | None, step: int, why: str | None) -> str:
    if level == "ok":
        return f"step {step}: {guard.name} is back within its band ({value:.4g})"
    side = "at or below" if guard.worse == "low" else "at or above"
    because = f"; {why}" if why else ""
    return f"step {step}: {guard.name} is {value:.4g}, {side} its {level} threshold {threshold:g}: {guard.doc}{because}"


@dataclass
class HealthMonitor:
    """A job's guards across its steps (the state a guard needs: the first entropy, the streak of
    zero updates, each guard's current level)."""

    spec: HealthSpec
    first_entropy: float | None = None
    stalled: int = 0
    levels: dict[str, Level] = field(default_factory=dict)
    better: dict[str, int] = field(default_factory=dict)  # steps in a row below each guard's level

    def values(self, metrics: Mapping[str, float], *, updated: bool) -> dict[GuardName, float]:
        """Each guard's value this step, where the step measured what it reads."""
        out: dict[GuardName, float] = {}
        if (tied := metrics.get("frac_reward_zero_std")) is not None:
            out["informative_groups"] = 1.0 - tied
        if (e := metrics.get("entropy")) is not None and math.isfinite(e):
            if self.first_entropy is None and e > 0:
                self.first_entropy = e
            if self.first_entropy:
                out["entropy"] = e / self.first_entropy
        if (t := metrics.get("completions/clipped_ratio")) is not None:
            out["truncation"] = t
        if (r := metrics.get("ratio/max")) is not None:
            out["ratio"] = r
        if (score := metrics.get("time/reward_s")) is not None and metrics.get("time/step_s"):
            out["grader_time"] = score / metrics["time/step_s"]
        if (failed := metrics.get("env/error_ratio")) is not None:
            out["environment"] = failed
        zero = not updated or metrics.get("grad_norm") == 0.0
        self.stalled = self.stalled + 1 if zero else 0
        out["update"] = float(self.stalled)
        return out

    def observe(self, step: int, metrics: Mapping[str, float], *, updated: bool = True,
                why: Mapping[GuardName, str] | None = None) -> StepHealth:
        """Read a step's metrics (`updated` False: a skipped step, no update made); `why`: in a guard's
        own words where the step knows them (the environment's error, say), what made its value."""
        changes, stop = [], None
        values = self.values(metrics, updated=updated)
        for name, value in values.items():
            guard, band = BY_NAME[name], getattr(self.spec, name)
            level, now = level_of(guard, value, band), self.levels.get(name, "ok")
            if LEVELS.index(level) >= LEVELS.index(now):
                self.better[name] = 0
                if level == now:
                    continue
            else:  # better: only once it has held for RECOVER_STEPS steps
                self.better[name] = self.better.get(name, 0) + 1
                if self.better[name] < RECOVER_STEPS:
                    continue
                self.better[name] = 0
            self.levels[name] = level
            threshold = None if level == "ok" else getattr(band, level)
            flag = HealthFlag(guard=name, level=level, step=step, value=value, threshold=threshold,
                              message=_message(guard, level, value, threshold, step, (why or {}).get(name)))
            changes.append(flag)
            if level == "critical" and name in self.spec.stop_on and stop is None:
                stop = flag
        return StepHealth(metrics={f"health/{k}": v for k, v in values.items()}, changes=changes, stop=stop)


def non_finite_flag(what: str, step: int | None) -> HealthFlag:
    where = f"step {step}: " if step is not None else ""
    return HealthFlag(guard="non_finite", level="critical", step=step, value=None, threshold=None,
                      message=f"{where}{what}; the job stops before the optimizer applies it (the last checkpoint "
                      "is kept)")


# Which guards a kind's steps feed (a session job's steps are its client's: none).
ALL_GUARDS: tuple[GuardName, ...] = tuple(g.name for g in GUARDS)
KIND_GUARDS: dict[str, tuple[GuardName, ...]] = {"grpo": ALL_GUARDS, "tracin": ALL_GUARDS,
                                                 "joint": tuple(g for g in ALL_GUARDS if g != "environment"),
                                                 "sft": ("update", "non_finite"), "session": ()}


@dataclass(frozen=True)
class JobHealth:
    """A job's health at a glance: the worst current level, and each guard's latest flag (a guard
    never flagged is ok)."""

    level: Level
    guards: dict[str, HealthFlag | None]


def summarise(kind: str, flags: Iterable[HealthFlag]) -> JobHealth:
    """From a job's health flags, oldest first: each guard's latest, and the worst of them."""
    latest: dict[str, HealthFlag | None] = {g: None for g in KIND_GUARDS.get(kind, ())}
    for f in flags:
        latest[f.guard] = f
    worst: Level = max((f.level for f in latest.values() if f is not None), key=LEVELS.index, default="ok")
    return JobHealth(worst, latest)


def flag_from_event(data: Mapping[str, Any] | None) -> HealthFlag | None:
    """A `health` event's data as a flag (None for data this version cannot read)."""
    if not data or data.get("guard") not in BY_NAME or data.get("level") not in LEVELS:
        return None
    return HealthFlag(guard=data["guard"], level=data["level"], step=data.get("step"), value=data.get("value"),
                      threshold=data.get("threshold"), message=str(data.get("message", "")))
