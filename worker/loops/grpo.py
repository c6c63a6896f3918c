"""GRPO / GRPO-Clip (Shao et al. 2024, "DeepSeekMath"; clip-higher from DAPO; Dr. GRPO options).

Per step:
  1. sync the frozen rollout copy from the policy (the adapter only, with LoRA);
  2. sample P prompts and G completions each from the rollout copy (optionally dropping groups
     whose rewards tie and refilling with fresh prompts); with rollout.max_staleness 1 the engine
     sampled them during the previous step, from the weights before its update;
  3. score with the weighted reward functions; group-normalised advantages (r - mean) / (std + eps);
  4. old_logp from the rollout copy with the sampler's temperature, so the first epoch's ratio is 1;
     ref_logp from the frozen reference when kl_coef > 0 (or grpo.measure_kl);
  5. epochs_per_rollout_batch epochs of: micro-batched clipped surrogate + kl_coef * k3 KL,
     gradient accumulation, gradient clipping, one AdamW step.
With one epoch the ratio stays 1 and this is REINFORCE with a group baseline.

Run it:  grpo-jobs run examples/grpo-minimal.yaml --out runs/grpo   (or submit it to the service)
"""

from __future__ import annotations

from functools import partial

from service.core.settings import Settings
from service.core.specs import GRPOJob
from worker.environments.runner import Stopped
from worker.loops import evaluation, skeleton, update, utilisation
from worker.loops.rollouts import Tied
from worker.loops.setup import build
from worker.loops.sources import TrainRollouts
from worker.parallel.distributed import SINGLE, Ranks
from worker.reporting import LoopResult, Reporter
from worker.training import seed_everything


def run(spec: GRPOJob, reporter: Reporter, *, settings: Settings, ranks: Ranks = SINGLE) -> LoopResult:
    g = spec.grpo
    seed_everything(g.seed)
    s = build(spec, settings, reporter, ranks=ranks)
    run = skeleton.start(s, reporter, partial(evaluation.evaluate, s))
    rollouts = TrainRollouts(s)  # with rollout.max_staleness 1, a step ahead
    for step in run.steps():
        if stopped := skeleton.stop_requested(run, step):
            return stopped
        timer = skeleton.begin_step(run, step)  # 1. seed, sync the rollout copy from the policy

        # 2-3. sample, score, advantages
        try:
            ro = rollouts.collect(step, reporter)
        except Stopped as exc:  # a cancel heard between the step's episodes
            return skeleton.stopped_in_step(run, step, str(exc))
        skeleton.rollouts_done(run, timer)
        if isinstance(ro, Tied):
            skeleton.skip_step(run, step, "every group's rewards tied", ro.metrics(), timer=timer)
            continue

        # 4. old and reference log-probs
        old_logp = update.old_logprobs(s, ro)  # [N, T], or None with one epoch (then logp.detach())
        ref_logp = update.reference_logprobs(s, ro.batch)  # [N, T] or None

        # 5. epochs of clipped-surrogate updates
        train_stats = update.train_epochs(run, ro, old_logp, ref_logp, step)
        timer.train_s = timer.elapsed() - timer.rollout_s
        metrics = {**ro.metrics(), **train_stats}
        metrics.update(utilisation.grpo_step(s, ro, metrics, rollout_s=timer.rollout_s, sync_s=timer.sync_s,
                                             train_s=timer.train_s))  # mfu/*: the share of the machine's peak

        skeleton.finish_step(run, step, metrics, timer=timer,
                             tokens=float(ro.batch.completion_mask.sum()), samples=ro.sample_rows(g.samples_per_step))
    return skeleton.finish(run)
