"""The step skeleton every loop shares, as small functions a loop calls in order:

    run = start(...)                        # build, resume, sparsity tracker, evaluation at step 0
    for step in run.steps():
        if stopped := stop_requested(run, step): return stopped
        timer = begin_step(run, step)       # seed, sync the rollout copy, start the clock
        ...what the kind does: rollouts, update...
        finish_step(run, step, metrics, ...)   # or skip_step(...) when there was nothing to learn
    return finish(run)                      # the final checkpoint

Both step ends read the step's metrics with the job's health guards (service/core/health.py):
a change of level is a `health` event, and a red guard the spec names in `health.stop_on` ends the
job after the step is recorded and checkpointed (`HealthStop`).

A loop stays readable top to bottom: only what is particular to its method sits between them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from service.core import health, tracing
from service.core.records import SampleRow
from worker.loops.setup import AnySpec, Setup, resume
from worker.machine import memory
from worker.model.checkpoints import gather_states, save_checkpoint
from worker.reporting import LoopResult, Records, Reporter
from worker.sparsity_tracker import SparsityTracker
from worker.training import seed_everything, step_seed

Evaluate = Callable[[int], dict[str, float]]  # the step after which it evaluates -> eval/* metrics


@dataclass
class Run:
    """A job's loop in progress: what was built, where results go, and how far it got."""

    s: Setup[AnySpec]
    reporter: Reporter
    evaluate: Evaluate  # greedy evaluation on the validation split -> eval/* metrics
    start_step: int = 0  # the last step done by an earlier attempt (0: a fresh start)
    opt_steps: int = 0  # optimizer steps taken (epochs count separately)
    step: int = 0  # the step in progress (begin_step sets it)
    tracker: SparsityTracker | None = None
    last_eval: dict[str, float] = field(default_factory=dict)
    health: health.HealthMonitor | None = None  # the job's guards (start() makes it)

    def steps(self) -> range:
        return range(self.start_step + 1, self.s.spec.train.steps + 1)

    def after_optimizer_step(self) -> None:
        self.opt_steps += 1
        if self.tracker is not None:
            self.tracker.on_optimizer_step(self.opt_steps)


def start(s: Setup[AnySpec], reporter: Reporter, evaluate: Evaluate) -> Run:
    """Resume from the last checkpoint if there is one; else evaluate before the first step (step 0)."""
    resumed = resume(s, reporter)
    run = Run(s=s, reporter=reporter, evaluate=evaluate, start_step=resumed.step, opt_steps=resumed.opt_steps,
              health=health.HealthMonitor(s.spec.health))
    # every rank holds the same weights: rank 0 measures (sharded ones are gathered by every rank)
    if s.spec.sparsity is not None and (s.ranks.main or s.sharded):
        run.tracker = SparsityTracker(s.spec.sparsity, s, reporter, start_step=run.opt_steps)
    if run.start_step == 0:
        with tracing.span("grpo_jobs.evaluate", **{"grpo_jobs.step": 0}):
            run.last_eval = evaluate(0)
        reporter.metrics(0, run.last_eval)
    return run


def save(run: Run, step: int) -> None:
    """Checkpoint folder step-N, its row in the store, and an event, by rank 0 (every rank holds
    the same weights; sharded ones are gathered first, by every rank)."""
    with tracing.span("grpo_jobs.checkpoint", **{"grpo_jobs.step": step}):
        full = gather_states(run.s.trainables()) if run.s.sharded else None
        if not run.s.ranks.main:
            return
        path = run.reporter.checkpoint_dir(step)
        extra = {"prompt_draw": run.s.prompt_draw.state_dict()} if run.s.prompt_draw is not None else None
        saved = save_checkpoint(path, run.s.trainables(), step=step, opt_steps=run.opt_steps, full=full, extra=extra)
        run.reporter.checkpoint(step, path, saved.format, saved.size_bytes)
    run.reporter.event("checkpoint", f"checkpoint at step {step} ({saved.size_bytes / 1e6:.1f} MB)",
                       data={"step": step, "format": saved.format, "size_bytes": saved.size_bytes})


def stop_requested(run: Run, step: int) -> LoopResult | None:
    """Cooperative cancel, checked between steps: checkpoint what was done and say so (the runner
    records the final `cancelled`)."""
    if not run.reporter.should_stop():
        return None
    save(run, step - 1)
    run.reporter.event("stopping", f"cancel requested: stopped before step {step}; checkpoint saved")
    return LoopResult("cancelled", step - 1, run.last_eval)


def stopped_in_step(run: Run, step: int, why: str) -> LoopResult:
    """A cancel heard inside step `step` (between its episodes): the step is dropped, having made no
    update; checkpoint what was done before it and say so."""
    tracing.end_step()
    save(run, step - 1)
    run.reporter.event("stopping", f"cancel requested: step {step} stopped ({why}); it made no update; "
                       "checkpoint saved")
    return LoopResult("cancelled", step - 1, run.last_eval)


@dataclass
class StepTimer:
    """Wall-clock phases of one step."""

    t0: float = field(default_factory=time.perf_counter)
    rollout_s: float = 0.0
    train_s: float = 0.0
    sync_s: float = 0.0  # loading the policy's weights into the rollout engine

    def rollouts_done(self) -> None:
        self.rollout_s = time.perf_counter() - self.t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def begin_step(run: Run, step: int) -> StepTimer:
    """Seed from (seed, step), so a resumed run samples what a straight one does; sync the frozen
    rollout copy with the policy (the adapter only, with LoRA); start the step's clock and its
    memory peak."""
    run.step = step
    tracing.begin_step(step)  # rl.loop, the parent of the step's phases until finish_step or skip_step
    memory.reset_peak(run.s.device)
    timer = StepTimer()
    seed_everything(step_seed(run.s.spec.train.seed, step))
    with tracing.span("rl.sync"):
        run.s.engine.sync(run.s.model)
    timer.sync_s = timer.elapsed()
    return timer


def rollouts_done(run: Run, timer: StepTimer) -> None:
    """The step's sampling is over and its training starts: the clock's rollout phase ends, and the engine
    may give memory back to the trainer until the next sync (a vLLM server on its GPU sleeps)."""
    timer.rollouts_done()
    run.s.engine.rest()


def evaluate_if_due(run: Run, step: int) -> dict[str, float]:
    """The evaluation after `step` when grpo.eval_every or the last step calls for one (else {})."""
    g = run.s.spec.train
    if g.eval_every and step % g.eval_every == 0 or step == g.steps:
        with tracing.span("grpo_jobs.evaluate", **{"grpo_jobs.step": step}):
            run.last_eval = run.evaluate(step)
        return run.last_eval
    return {}


def memory_metrics(run: Run) -> dict[str, float]:
    """The step's memory (memory/rss_gb, memory/peak_rss_gb, ...) and the job's checkpointing choice."""
    plan = run.s.memory_plan.metrics() if run.s.memory_plan is not None else {}
    return {**memory.measure(run.s.device).metrics(), **plan}


class HealthStop(RuntimeError):
    """A red health guard that the spec's `health.stop_on` names: the job ends failed, its step
    recorded and checkpointed."""


def report_health(reporter: Records, flags: Sequence[health.HealthFlag]) -> None:
    for f in flags:
        reporter.event(health.EVENT, f.message, level=health.EVENT_LEVEL[f.level], data=f.event_data())


def read_health(run: Run, step: int, metrics: dict[str, float], *, updated: bool) -> health.StepHealth:
    """The guards' reading of a finished step: its health/* metrics, and an event per change of level.
    A step of an environment's episodes whose groups all tied gets its env/* figures added to `metrics`."""
    assert run.health is not None, "start() makes the guards"
    why: dict[health.GuardName, str] = {}
    if run.s.environment is not None and (played := run.s.environment.tally.take(step)) is not None:
        metrics.update({k: v for k, v in played.metrics().items() if k not in metrics})  # a step whose groups tied
        if (failed := played.why()) is not None:
            why["environment"] = failed
    reading = run.health.observe(step, metrics, updated=updated, why=why)
    report_health(run.reporter, reading.changes)
    return reading


def stop_if_unhealthy(run: Run, step: int, reading: health.StepHealth, *, saved: bool = False) -> None:
    if reading.stop is None:
        return
    if not saved:
        save(run, step)
    raise HealthStop(f"{reading.stop.message} (health.stop_on names {reading.stop.guard})")


def skip_step(run: Run, step: int, why: str, metrics: dict[str, float], *, timer: StepTimer,
              samples: Sequence[SampleRow] = ()) -> None:
    """A step with nothing to learn from: no update, a warning event, what was measured, and the
    evaluation when one is due (the last step's is the job's result)."""
    run.reporter.event("skipped", f"step {step}: {why}; no update", level="warning")
    metrics = {**metrics, **evaluate_if_due(run, step), "time/rollout_s": timer.rollout_s,
               "time/step_s": timer.elapsed(), **memory_metrics(run)}
    reading = read_health(run, step, metrics, updated=False)
    run.reporter.metrics(step, {**metrics, **reading.metrics})
    if samples:
        run.reporter.samples(step, list(samples))
    run.reporter.progress(step)
    tracing.end_step(None, **{"grpo_jobs.skipped": True})
    stop_if_unhealthy(run, step, reading)


def finish_step(run: Run, step: int, metrics: dict[str, float], *, timer: StepTimer, tokens: float,
                samples: Sequence[SampleRow] = ()) -> None:
    """The end of every step: sparsity, evaluation when due, timings, samples, progress, checkpoint.
    `tokens`: this rank's completion tokens."""
    g = run.s.spec.train
    metrics = dict(metrics)
    tokens = run.s.ranks.sum({"tokens": tokens})["tokens"]
    if run.tracker is not None:
        metrics.update(run.tracker.pop_metrics())
    metrics.update(evaluate_if_due(run, step))
    dt = timer.elapsed()
    metrics.update({"time/rollout_s": timer.rollout_s, "time/train_s": timer.train_s, "time/sync_s": timer.sync_s,
                    "time/step_s": dt, "throughput/tokens_per_s": tokens / dt, **memory_metrics(run)})
    if not metrics.get("rollout/staleness"):  # rows sampled during the last step: the clock saw only the wait
        metrics["throughput/rollout_tokens_per_s"] = tokens / max(timer.rollout_s - timer.sync_s, 1e-9)
    reading = read_health(run, step, metrics, updated=True)
    run.reporter.metrics(step, {**metrics, **reading.metrics})
    if samples:
        run.reporter.samples(step, list(samples))
    run.reporter.progress(step)
    due = g.checkpoint_every and step % g.checkpoint_every == 0 and step != g.steps
    if due:
        save(run, step)
    tracing.end_step(None, **{"grpo_jobs.tokens": tokens})
    stop_if_unhealthy(run, step, reading, saved=bool(due))


def finish(run: Run) -> LoopResult:
    """The final checkpoint; the result the runner records."""
    steps = run.s.spec.train.steps
    save(run, steps)
    return LoopResult("succeeded", steps, run.last_eval)
