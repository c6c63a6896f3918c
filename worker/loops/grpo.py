"""GRPO / GRPO-Clip (Shao et al. 2024, "DeepSeekMath"; clip-higher from DAPO; Dr. GRPO options).

Per step:
  1. sync the frozen rollout copy from the policy (the adapter only, with LoRA);
  2. sample P prompts and G completions each from the rollout copy (optionally dropping groups
     whose rewards tie and refilling with fresh prompts);
  3. score with the weighted reward functions; group-normalised advantages (r - mean) / (std + eps);
  4. old_logp from the rollout copy with the sampler's temperature, so the first epoch's ratio is 1;
     ref_logp from the frozen reference when kl_coef > 0;
  5. epochs_per_rollout_batch epochs of: micro-batched clipped surrogate + kl_coef * k3 KL,
     gradient accumulation, gradient clipping, one AdamW step.
With one epoch the ratio stays 1 and this is REINFORCE with a group baseline.

Run it:  grpo-jobs run examples/grpo-minimal.yaml --out runs/grpo   (or submit it to the service)
"""

from __future__ import annotations

import time

import torch

from service.settings import Settings
from service.specs import GRPOJob
from worker.loops import steps as S
from worker.reporting import Reporter
from worker.sparsity_hook import SparsityTracker
from worker.training import seed_everything, step_seed


def run(spec: GRPOJob, reporter: Reporter, *, settings: Settings) -> dict:
    g = spec.grpo
    seed_everything(g.seed)
    s = S.build(spec, settings, reporter)
    S.resume_if_possible(s, reporter)
    tracker = SparsityTracker.maybe(spec, s, reporter)

    last_eval = S.initial_eval(s, reporter)
    for step in range(s.start_step + 1, g.steps + 1):
        if stopped := S.stop_requested(s, reporter, step):
            return stopped
        t0 = time.perf_counter()
        seed_everything(step_seed(g.seed, step))

        # 1-3. sync, sample, score, advantages
        s.engine.sync(s.model)
        ro = S.collect_rollouts(s, step, reporter)
        t_rollout = time.perf_counter() - t0
        if ro is None:
            reporter.event("skipped", f"step {step}: every group's rewards tied; no update", level="warning")
            reporter.metrics(step, {"frac_reward_zero_std": 1.0, "time/step_s": time.perf_counter() - t0})
            reporter.progress(step)
            continue

        # 4. old and reference log-probs
        old_logp = S.old_logprobs(s, ro)  # [N, T], or None with one epoch (then logp.detach())
        ref_logp = S.reference_logprobs(s, ro.batch)  # [N, T] or None

        # 5. epochs of clipped-surrogate updates
        t1 = time.perf_counter()
        train_stats = S.train_epochs(s, ro, old_logp, ref_logp, step,
                                     on_opt_step=tracker.on_optimizer_step if tracker else None)
        t_train = time.perf_counter() - t1

        metrics = {**S.rollout_metrics(ro), **train_stats, **(tracker.pop_metrics() if tracker else {})}
        if g.eval_every and step % g.eval_every == 0 or step == g.steps:
            last_eval = S.evaluate(s)
            metrics.update(last_eval)
        dt = time.perf_counter() - t0
        metrics.update({"time/rollout_s": t_rollout, "time/train_s": t_train, "time/step_s": dt,
                        "throughput/tokens_per_s": float(ro.batch.completion_mask.sum()) / dt})
        reporter.metrics(step, metrics)
        if g.samples_per_step:
            reporter.samples(step, S.sample_rows(ro, g.samples_per_step))
        reporter.progress(step)
        if g.checkpoint_every and step % g.checkpoint_every == 0 and step != g.steps:
            S.checkpoint(s, reporter, step)

    S.checkpoint(s, reporter, g.steps)
    return {"status": "succeeded", "step": g.steps, **{k: v for k, v in last_eval.items()}}
