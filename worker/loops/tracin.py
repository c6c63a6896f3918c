"""TracIn-selected GRPO (LoRA): train only on the samples whose gradient helps a validation batch.

Per step, on top of the GRPO step of worker/loops/grpo.py:
  1. a validation batch: `tracin.val_prompts` validation prompts x `tracin.val_generations` sampled
     responses, scored and group-normalised, regenerated every `tracin.val_regenerate_every` steps;
  2. its loss (the same clipped surrogate, summed into one direction) is backpropagated and the
     LoRA gradient G_val is kept per layer;
  3. the training batch's forward/backward runs with ghost hooks: sample i's influence
     <grad L_i, G_val> is accumulated from rank-r projections (worker/algos/influence.py);
  4. a selection policy (positive / top_fraction / greedy / random) keeps samples;
  5. the update uses only the selected samples, each with the weight it has in the whole batch's
     loss. With one epoch per rollout batch their gradient is recovered from the same hooks (no
     second backward; with `positive`, folded in micro-batch by micro-batch); with more epochs,
     the epochs run on them.
With no sample selected the step makes no update, and an event says so.

Run it:  grpo-jobs run examples/tracin-minimal.yaml --out runs/tracin
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from service.settings import Settings
from service.specs import TracInJob
from worker.algos import selection as sel
from worker.algos.influence import GhostHooks
from worker.algos.losses import per_sample_loss
from worker.loops import steps as S
from worker.reporting import Reporter
from worker.rollout import sequence_logprobs
from worker.sparsity_hook import SparsityTracker
from worker.training import grad_norm, seed_everything, step_seed


def _backward_per_sample(s: S.Setup, ro: S.Rollouts, ref_logp, hooks: GhostHooks | None, *,
                         with_entropy: bool = True, after_micro_batch: Callable[[], None] | None = None,
                         ) -> dict[str, float]:
    """Forward/backward of every sample's loss share, in micro-batches (the hooks see each one)."""
    g = s.spec.grpo
    n = len(ro.batch)
    tokens = float(ro.loss_mask.sum().clamp(min=1.0))
    total, ent, ntok = 0.0, 0.0, 0.0
    for rows in S.micro_batches(n, g.micro_batch_size):
        idx = torch.tensor(rows)
        mb = ro.batch.select(rows).to(s.device)
        mask = ro.loss_mask[idx].to(s.device)
        if hooks is not None:
            hooks.rows = idx  # the forward hooks place this micro-batch's samples by these rows
        logp, e = sequence_logprobs(s.model, mb, g.temperature, with_entropy=with_entropy)
        losses = per_sample_loss(  # one epoch: old_logp is the rollout weights' = logp.detach()
            logp, logp.detach(), ro.advantages[idx].to(s.device), mask, batch_tokens=tokens, batch_size=n,
            ref_logp=None if ref_logp is None else ref_logp[idx].to(s.device),
            clip_eps_low=g.clip_eps_low, clip_eps_high=g.clip_eps_high, kl_coef=g.kl_coef, agg=g.loss_agg)
        losses.sum().backward()
        if after_micro_batch is not None:
            after_micro_batch()
        total += float(losses.detach().sum())
        ent += float((e * mask).sum()) if with_entropy else 0.0
        ntok += float(mask.sum())
    return {"loss/total": total, "entropy": ent / max(ntok, 1.0)}


def _select(spec: TracInJob, scores: torch.Tensor, hooks: GhostHooks, step: int) -> torch.Tensor:
    t = spec.tracin
    if t.selection == "positive":
        return sel.positive(scores)
    if t.selection == "top_fraction":
        return sel.top_fraction(scores, t.fraction)
    if t.selection == "random":
        return sel.random_subset(scores.numel(), t.fraction, torch.Generator().manual_seed(step_seed(spec.grpo.seed, step)))
    return sel.greedy(scores, hooks.gram(), t.fraction, eta=spec.grpo.learning_rate)


def run(spec: TracInJob, reporter: Reporter, *, settings: Settings) -> dict:
    g, t = spec.grpo, spec.tracin
    seed_everything(g.seed)
    s = S.build(spec, settings, reporter)
    S.resume_if_possible(s, reporter)
    tracker = SparsityTracker.maybe(spec, s, reporter)
    one_epoch = g.epochs_per_rollout_batch == 1

    # One epoch and a per-sample rule: a micro-batch's selected samples are folded into the update
    # as soon as its backward ends, so no per-sample factors outlive their micro-batch.
    stream_positive = one_epoch and t.selection == "positive"
    last_eval = S.initial_eval(s, reporter)
    val_ro = val_ref = None
    for step in range(s.start_step + 1, g.steps + 1):
        if stopped := S.stop_requested(s, reporter, step):
            return stopped
        t0 = time.perf_counter()
        seed_everything(step_seed(g.seed, step))

        # 1. rollouts: the training batch, and (every val_regenerate_every steps) the validation batch
        s.engine.sync(s.model)
        ro = S.collect_rollouts(s, step, reporter)
        val_stats = {}
        if val_ro is None or (step - 1) % t.val_regenerate_every == 0:
            # tied validation groups have zero advantages and add nothing to G_val: replace them
            val_ro = S.collect_rollouts(s, step, reporter, examples_pool=s.task.val, prompts_per_step=t.val_prompts,
                                        group_size=t.val_generations, tag="val", drop_zero_std=True)
            val_ref = None if val_ro is None else S.reference_logprobs(s, val_ro.batch)  # frozen: once per batch
            if val_ro is not None:  # each refill round is one more generate call on this step
                val_stats["tracin/val_refill_rounds"] = float(val_ro.stats["refill_rounds"])
        t_rollout = time.perf_counter() - t0
        if ro is None or val_ro is None:
            which = "training" if ro is None else "validation"
            reporter.event("skipped", f"step {step}: every {which} group's rewards tied (no signal); no update",
                           level="warning")
            skipped = {**val_stats, "tracin/num_selected": 0.0, "tracin/selection_ratio": 0.0,
                       "time/step_s": time.perf_counter() - t0}
            if ro is not None:  # G_val = 0, so every influence is exactly 0 and nothing is selected
                n = len(ro.batch)
                reporter.selection({"step": step, "policy": t.selection, "total": n, "selected": 0, "ratio": 0.0,
                                    "mean_influence": 0.0, "min_influence": 0.0, "max_influence": 0.0,
                                    "histogram": sel.histogram(torch.zeros(n)),
                                    "scores": [[i, 0.0, False] for i in range(n)]})
                skipped["tracin/mean_ip"] = 0.0
                if g.samples_per_step:  # what was generated stays inspectable on skipped steps too
                    reporter.samples(step, S.sample_rows(ro, n, influence=[0.0] * n, selected=[False] * n))
            reporter.metrics(step, {**(S.rollout_metrics(ro) if ro is not None else {}), **skipped})
            reporter.progress(step)
            continue
        old_logp = None if one_epoch else s.engine.logprobs(ro.batch, g.micro_batch_size)
        ref_logp = S.reference_logprobs(s, ro.batch)

        # 2-3. validation gradient, then the training backward with ghost influence scores
        t1 = time.perf_counter()
        s.model.train()
        s.optimizer.zero_grad(set_to_none=True)
        with GhostHooks(s.model, keep_factors=one_epoch or t.selection == "greedy") as hooks:
            _backward_per_sample(s, val_ro, val_ref, None, with_entropy=False)
            hooks.capture_validation_gradient()
            t_val = time.perf_counter() - t1
            hooks.start_scoring(len(ro.batch), "cpu")
            fold_positive = (lambda: hooks.fold(sel.positive(hooks.scores).double())) if stream_positive else None
            stats = _backward_per_sample(s, ro, ref_logp, hooks, after_micro_batch=fold_positive)

        # 4. selection (on the float64 scores, the ones the streamed fold used)
        t2 = time.perf_counter()
        chosen = _select(spec, hooks.scores, hooks, step)  # bool [N]
        scores = hooks.scores.float()  # [N]
        rows = chosen.nonzero().flatten().tolist()
        t_select = time.perf_counter() - t2
        reporter.selection({
            "step": step, "policy": t.selection, "total": len(scores), "selected": len(rows),
            "ratio": len(rows) / len(scores), "mean_influence": float(scores.mean()),
            "min_influence": float(scores.min()), "max_influence": float(scores.max()),
            "histogram": sel.histogram(scores),
            "scores": [[i, float(v), bool(c)] for i, (v, c) in enumerate(zip(scores, chosen))]})

        # 5. update on the selected samples only
        metrics = {**S.rollout_metrics(ro), **val_stats, **stats}
        if not rows:
            s.optimizer.zero_grad(set_to_none=True)
            reporter.event("no_selection", f"step {step}: no sample had positive influence; no update",
                           level="warning", data={"max_influence": float(scores.max())})
        elif one_epoch:
            # Selected samples keep the weight they have in the whole batch's loss; the rest get 0.
            # (AdamW is invariant to a constant loss scale, so this is a definition, not a step size.)
            if not stream_positive:
                hooks.fold(chosen.double())
            recovered = hooks.subset
            for p in (p for group in s.optimizer.param_groups for p in group["params"]):
                p.grad = recovered.get(p, torch.zeros_like(p)).to(p.dtype)
            params = [p for group in s.optimizer.param_groups for p in group["params"]]
            norm = (float(torch.nn.utils.clip_grad_norm_(params, g.max_grad_norm)) if g.max_grad_norm
                    else grad_norm(params))
            s.optimizer.step()
            s.scheduler.step()
            s.opt_steps += 1
            if tracker:
                tracker.on_optimizer_step(s.opt_steps)
            metrics.update({"grad_norm": norm, "lr": s.scheduler.get_last_lr()[0]})
        else:
            s.optimizer.zero_grad(set_to_none=True)
            metrics.update(S.train_epochs(s, ro, old_logp, ref_logp, step, rows=rows, whole_batch_weights=True,
                                          on_opt_step=tracker.on_optimizer_step if tracker else None))
        hooks.factors.clear()
        hooks.subset.clear()
        t_train = time.perf_counter() - t1

        if tracker:
            metrics.update(tracker.pop_metrics())
        if g.eval_every and step % g.eval_every == 0 or step == g.steps:
            last_eval = S.evaluate(s)
            metrics.update(last_eval)
        dt = time.perf_counter() - t0
        metrics.update({
            "tracin/mean_ip": float(scores.mean()), "tracin/num_selected": float(len(rows)),
            "tracin/selection_ratio": len(rows) / len(scores), "tracin/time_s": t_val + t_select,
            "time/rollout_s": t_rollout, "time/train_s": t_train, "time/step_s": dt,
            "throughput/tokens_per_s": float(ro.batch.completion_mask.sum()) / dt})
        reporter.metrics(step, metrics)
        if g.samples_per_step:
            reporter.samples(step, S.sample_rows(ro, len(ro.batch), influence=scores.tolist(),
                                                 selected=chosen.tolist()))
        reporter.progress(step)
        if g.checkpoint_every and step % g.checkpoint_every == 0 and step != g.steps:
            S.checkpoint(s, reporter, step)

    S.checkpoint(s, reporter, g.steps)
    return {"status": "succeeded", "step": g.steps, **last_eval}
