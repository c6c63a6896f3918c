"""TracIn's claim, checked on every step: the predicted change of the validation objective against the
change that happened.

The validation objective L_val(theta) is the loss whose gradient G_val the training samples are scored
against: the validation batch's clipped GRPO surrogate (plus the KL term when the job has one), with
its ratios taken against the batch's log-probs at theta_t, so every ratio is exactly 1 at theta_t.
Lower is better. Per step with an update:

    predicted_delta     = <G_val, theta_{t+1} - theta_t>        first order, for any optimizer (Adam too)
    predicted_delta_trapezoid = 1/2 <G_val(theta_t) + G_val(theta_{t+1}), theta_{t+1} - theta_t>
                                                            exact for a quadratic L_val: where it is right and the
                                                            first order is not, the step's curvature is the gap
    predicted_delta_sgd = -lr * sum_{i selected} score_i    the influence scores (tracin.score) read as one step
    actual_delta        = L_val(theta_{t+1}) - L_val(theta_t)   re-evaluated on the same validation rollouts

The evaluations and G_val(theta_{t+1}) run without dropout (eval mode), so the actual change is the
weights' doing alone. In a model without dropout the training forward is the evaluation's, so L_val(theta_t)
and its log-probs are the validation backward's that took G_val (TracIn's step 2), not a pass of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.algos.influence import GhostHooks
from worker.loops import update
from worker.loops.rollouts import Rollouts
from worker.loops.setup import RLJob, Setup
from worker.model.forward import batch_logprobs
from worker.training import eval_mode, trainable


@dataclass(frozen=True)
class Objective:
    """L_val at some weights, and the log-probs it was taken from."""

    value: float  # over every rank's rows
    logp: torch.Tensor  # [N_val, T] this rank's rows


def objective(s: Setup[RLJob], ro: Rollouts[Any], old_logp: torch.Tensor | None,
              ref_logp: torch.Tensor | None) -> Objective:
    """L_val at the current weights; old_logp None: the ratios are taken against these log-probs, so L_val is
    its value at theta_t. Summed micro-batch by micro-batch in update.backward_pass's order, so `gradient`'s
    value at theta_{t+1} is comparable with it to the last bit: their difference is the step's actual change."""
    g = s.spec.grpo
    micro = update.micro(s, ro.batch, list(range(len(ro))))
    with eval_mode(s.model):
        logp = batch_logprobs(s.model, ro.batch, g.temperature, micro, s.device)
    old = logp if old_logp is None else old_logp
    mask = ro.loss_mask.to(s.device)
    parts = update.losses(s, logp, old, ro.advantages.to(s.device), mask, update.batch_normaliser(s, ro.loss_mask),
                          None if ref_logp is None else ref_logp.to(s.device),
                          update.correction(s, ro.batch, old, mask))
    return Objective(value=s.ranks.sum({"loss": sum(float(parts.loss[rows].sum()) for rows in micro)})["loss"],
                     logp=logp)


@dataclass(frozen=True)
class Before:
    """What the check keeps from theta_t."""

    logp: torch.Tensor  # [N_val, T] validation log-probs at theta_t: the ratios' denominators
    value: float  # L_val(theta_t)
    weights: list[torch.Tensor]  # every LoRA A and B at theta_t, in GhostHooks.val_grads order


def before_update(s: Setup[RLJob], val_ro: Rollouts[Any], val_ref: torch.Tensor | None, hooks: GhostHooks,
                  *, known: Objective | None = None) -> Before:
    """theta_t's weights, and L_val there: `known` where the validation backward that took G_val gave it (a
    model without dropout, whose training forward is the evaluation's), else from a forward of its own."""
    at = known if known is not None else objective(s, val_ro, None, val_ref)
    weights = [w.detach().clone() for layer in hooks.layers for w in (layer.a.weight, layer.b.weight)]
    return Before(logp=at.logp, value=at.value, weights=weights)


def gradient(s: Setup[RLJob], ro: Rollouts[Any], old_logp: torch.Tensor, ref_logp: torch.Tensor | None, step: int,
             hooks: GhostHooks) -> tuple[float, list[torch.Tensor]]:
    """L_val (ratios against `old_logp`) and its gradient at the current weights, without dropout, over
    every LoRA A and B in GhostHooks.val_grads order: every rank's rows. Leaves .grad cleared."""
    s.optimizer.zero_grad(set_to_none=True)
    with eval_mode(s.model):
        totals = update.backward_pass(s, ro, update.micro(s, ro.batch, list(range(len(ro)))),
                                      update.batch_normaliser(s, ro.loss_mask), old_logp, ref_logp, step,
                                      with_entropy=False)
    s.ranks.reduce_gradients(trainable(s.model))
    out = [(w.grad if w.grad is not None else torch.zeros_like(w)).detach().clone()
           for layer in hooks.layers for w in (layer.a.weight, layer.b.weight)]
    s.optimizer.zero_grad(set_to_none=True)
    return s.ranks.sum({"loss": totals.loss})["loss"], out


def after_update(s: Setup[RLJob], val_ro: Rollouts[Any], val_ref: torch.Tensor | None, hooks: GhostHooks, before: Before,
                 *, selected_influence: float, lr: float, step: int) -> dict[str, float]:
    """The step's metrics: the predictions and the actual change (G_val is still in the hooks); L_val at
    theta_{t+1} comes with its gradient, from one forward."""
    grads = [g for i in range(len(hooks.layers)) for g in hooks.val_grads[i]]
    value, grads_after = gradient(s, val_ro, before.logp, val_ref, step, hooks)
    now = [w for layer in hooks.layers for w in (layer.a.weight, layer.b.weight)]
    deltas = [w.detach().double() - w0.double() for w, w0 in zip(now, before.weights)]
    predicted = sum(float((g.double() * d).sum()) for g, d in zip(grads, deltas))
    after = sum(float((g.double() * d).sum()) for g, d in zip(grads_after, deltas))
    return {"tracin/predicted_delta": predicted, "tracin/predicted_delta_trapezoid": 0.5 * (predicted + after),
            "tracin/predicted_delta_sgd": -lr * selected_influence,
            "tracin/actual_delta": value - before.value, "tracin/val_objective": before.value}
