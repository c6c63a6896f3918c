"""TracIn-selected GRPO (LoRA): train only on the samples whose gradient helps a validation batch.

Per step, on top of the GRPO step of worker/loops/grpo.py:
  1. a validation batch: `tracin.val_prompts` validation prompts x `tracin.val_generations` sampled
     responses, scored and group-normalised, regenerated every `tracin.val_regenerate_every` steps;
  2. its loss (the same clipped surrogate, summed into one direction) is backpropagated and the
     LoRA gradient G_val is kept per layer;
  3. the training batch's forward/backward runs with ghost hooks: sample i's influence
     <grad L_i, G_val> is accumulated from rank-r projections (worker/algos/influence.py), a group's
     prompt run once (its positions' part of each row's score from leaves of the row's own,
     worker/model/prefix.py, where Setup.share_prompts allows); with
     `tracin.score` adam it is <grad L_i, D_t * G_val> instead, sample i's first-order effect
     through this step's AdamW update, read from the kept factors once the batch's gradient is
     known (adam_fixed_state likewise, without D_t's moment term); with adam_prior_state (auto's
     choice for positive and top_fraction) AdamW's preconditioner from its moments before the step,
     known before the backward and streamed like G_val itself;
  4. a selection policy (positive / top_fraction / top_cosine / greedy) keeps samples;
  5. the update uses only the selected samples, each with the weight it has in the whole batch's
     loss. With one epoch per rollout batch their gradient is recovered from the same hooks (no
     second backward; with `positive`, folded in micro-batch by micro-batch); with more epochs,
     the epochs run on them;
  6. (`tracin.check_prediction`) the validation objective is re-evaluated after the update, and its
     predicted change is recorded beside the actual one (worker/loops/prediction.py).
With no sample selected the step makes no update, and an event says so.

The baselines (random, pass_rate, all) skip 1-4 and 6: no validation batch and no influence, so their
step costs what plain GRPO's does, and `all` is uniform GRPO.

Run it:  grpo-jobs run examples/tracin-minimal.yaml --out runs/tracin
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from service.core.records import SelectionRecord
from service.core.settings import Settings
from service.core.specs import BASELINES, PAIRWISE, TracInJob
from worker import rewards
from worker.algos import selection as sel
from worker.algos.influence import GhostHooks, Moments, adam_direction
from worker.environments.runner import Stopped
from worker.loops import evaluation, prediction, skeleton, update
from worker.loops.rollouts import Rollouts, Tied, collect_rollouts
from worker.loops.setup import Setup, build, of_kind
from worker.loops.sources import TrainRollouts, draw_validation
from worker.model import prefix
from worker.parallel.distributed import SINGLE, Ranks
from worker.reporting import LoopResult, Records, Reporter
from worker.training import grad_norm, has_dropout, seed_everything, step_seed, trainable


def backward_per_sample(s: Setup[TracInJob], ro: Rollouts[Any], ref_logp: torch.Tensor | None, step: int,
                        hooks: GhostHooks | None = None, *, with_entropy: bool = True,
                        after_micro_batch: Callable[[], None] | None = None,
                        record: torch.Tensor | None = None) -> update.PassTotals:
    """Every sample's share of the batch loss, forward and backward in micro-batches, and the pass's totals over
    every rank: the hooks see each one and place its samples by their rows. Where rows share their prompt's forward
    (Setup.share_prompts), the hooks also take what each micro-batch's prompts add to its rows
    (worker/model/prefix.py). `record` [N, T] receives the log-probs."""
    place = None if hooks is None else (lambda rows: hooks.place(torch.tensor(rows)))
    with prefix.taped_prompts() if hooks is not None else contextlib.nullcontext() as tape:

        def after() -> None:
            if tape is not None and hooks is not None:
                for part in tape.parts:
                    hooks.add_prompt(part)
                tape.parts.clear()
            if after_micro_batch is not None:
                after_micro_batch()

        p = update.backward_pass(s, ro, update.micro(s, ro.batch, list(range(len(ro)))),
                                 update.batch_normaliser(s, ro.loss_mask), None, ref_logp, step,
                                 with_entropy=with_entropy, before=place, after=after, record=record)
    return p.reduced(s.ranks)


# the moments each AdamW geometry of `tracin.score` takes D_t with (worker/algos/influence.adam_direction)
MOMENTS: dict[str, Moments] = {"adam": "batch", "adam_fixed_state": "fixed", "adam_prior_state": "prior"}


def adam_directions(s: Setup[TracInJob], hooks: GhostHooks, *, moments: Moments) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per LoRA layer, the A and B directions c * D_t * G_val that `tracin.score: adam*` scores
    against (worker/algos/influence.py): D_t from AdamW's moments before this step and the batch
    gradient gbar it will see, which is every rank's .grad summed (so call this right after the
    training backward), scaled by the clip factor c of max_grad_norm, held fixed in w_i. With
    `moments="prior"` neither gbar nor c (a factor on every score alike) is needed: call it before."""
    params = trainable(s.model)
    clip = 1.0
    if moments != "prior":
        s.ranks.reduce_gradients(params)
        max_norm = s.spec.train.max_grad_norm
        norm = grad_norm(params)
        clip = 1.0 if max_norm is None else min(1.0, max_norm / (norm + 1e-6))  # clip_grad_norm_'s factor
    group = s.optimizer.param_groups[0]
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in enumerate(hooks.layers):
        pair = []
        for p, g_val in zip((layer.a.weight, layer.b.weight), hooks.val_grads[i]):
            state = s.optimizer.state.get(p, {})
            gbar = None if moments == "prior" else clip * (p.grad if p.grad is not None else torch.zeros_like(p))
            d = adam_direction(g_val, gbar, state.get("exp_avg"), state.get("exp_avg_sq"),
                               step=int(state["step"]) + 1 if "step" in state else 1, betas=group["betas"],
                               eps=group["eps"], moments=moments)
            pair.append(clip * d)
        out[i] = (pair[0], pair[1])
    return out


def select(spec: TracInJob, scores: torch.Tensor, hooks: GhostHooks, step: int, ro: Rollouts[Any]) -> torch.Tensor:
    """bool [N]: the samples of the whole batch (every rank's) that a selection by influence keeps."""
    t = spec.tracin
    if t.selection == "positive":
        return sel.positive(scores)
    if t.selection == "top_fraction":
        return sel.top_fraction(scores, t.fraction)
    gram = hooks.gram(ro.gather)
    if t.selection == "top_cosine":
        return sel.top_cosine(scores, gram.diagonal(), t.fraction)
    return sel.greedy(scores, gram, t.fraction, eta=spec.grpo.learning_rate)


def select_baseline(s: Setup[TracInJob], ro: Rollouts[Any], step: int) -> torch.Tensor:
    """bool [N]: the samples of the whole batch that a baseline keeps, without influence."""
    t, n = s.spec.tracin, ro.total
    if t.selection == "all":
        return torch.ones(n, dtype=torch.bool)
    if t.selection == "random":
        return sel.random_subset(n, t.fraction, torch.Generator().manual_seed(step_seed(s.spec.grpo.seed, step)))
    check = rewards.REGISTRY[s.spec.dataset.accuracy_check].fn
    G = ro.group_size
    correct = torch.tensor([float(check(c, ro.examples[i // G].answers)) for i, c in enumerate(ro.batch.completions)])
    return sel.pass_rate(ro.gather(correct), G, t.fraction)


def selection_record(step: int, policy: str, scores: torch.Tensor, chosen: torch.Tensor) -> SelectionRecord:
    n = len(scores)
    return SelectionRecord(step=step, policy=policy, total=n, selected=int(chosen.sum()), ratio=int(chosen.sum()) / n,
                           mean_influence=float(scores.mean()), min_influence=float(scores.min()),
                           max_influence=float(scores.max()), histogram=sel.histogram(scores),
                           scores=[(i, float(v), bool(c)) for i, (v, c) in enumerate(zip(scores, chosen))])


def apply_recovered_gradient(run: skeleton.Run, hooks: GhostHooks) -> dict[str, float]:
    """One epoch: the selected samples' gradient, recovered from the hooks, is the update."""
    for p in (p for group in run.s.optimizer.param_groups for p in group["params"]):
        p.grad = hooks.subset_gradient(p).to(p.dtype)
    return {"grad_norm": update.optimizer_step(run), "lr": float(run.s.scheduler.get_last_lr()[0])}


@dataclass
class Validation:
    """The validation batch (None: every group tied) and its frozen reference log-probs."""

    ro: Rollouts[Any] | None = None
    ref_logp: torch.Tensor | None = None


def validation_batch(s: Setup[TracInJob], val: Validation, step: int, reporter: Records) -> dict[str, float]:
    """1. Draw the validation batch every `tracin.val_regenerate_every` steps (and on every step while
    there is none), replacing tied groups (zero advantages add nothing to G_val); its refill rounds
    when it was drawn this step."""
    g, t = s.spec.grpo, s.spec.tracin
    if val.ro is not None and (step - 1) % t.val_regenerate_every:
        return {}
    draw = draw_validation(s, t.val_generations, seed_tag=f"prompts-val-{g.seed}-{step}")
    found = collect_rollouts(s, step, reporter, draw, units=t.val_prompts, group_size=t.val_generations,
                             drop_zero_std=True)
    val.ro = None if isinstance(found, Tied) else found
    val.ref_logp = None if val.ro is None else update.reference_logprobs(s, val.ro.batch)  # frozen: once per batch
    # each refill round is one more generate call on this step
    return {} if val.ro is None else {"tracin/val_refill_rounds": float(val.ro.refill_rounds)}


@dataclass(frozen=True)
class Scored:
    """2-4. Every sample's influence and which samples the selection policy kept."""

    every: torch.Tensor  # float64 [N over all ranks], in the whole batch's order
    chosen_all: torch.Tensor  # bool [N over all ranks]
    chosen: torch.Tensor  # bool [this rank's rows]
    mine: torch.Tensor  # float32 [this rank's rows]: their influence
    train_stats: dict[str, float]  # the training backward's metrics
    time_s: float  # validation gradient + selection
    val_at_theta_t: prediction.Objective | None  # L_val where G_val was taken; None: the model has dropout

    @property
    def n_selected(self) -> int:
        return int(self.chosen_all.sum())


def score_and_select(s: Setup[TracInJob], ro: Rollouts[Any], val: Validation, ref_logp: torch.Tensor | None, step: int,
                     hooks: GhostHooks, *, stream_positive: bool) -> Scored:
    """2. the validation gradient G_val; 3. the training backward, scoring <grad L_i, G_val> with the
    hooks (with `stream_positive`, each micro-batch's positive samples are folded as it ends, so no
    per-sample factors outlive it), rescored in AdamW's geometry with `tracin.score` adam*; 4. the
    selection over the whole batch, on the float64 scores."""
    assert val.ro is not None, "a step with no validation batch is skipped before it scores"
    t0 = time.perf_counter()
    s.model.train()
    s.optimizer.zero_grad(set_to_none=True)
    # without dropout the validation backward's forward is the prediction check's evaluation at theta_t: kept
    val_logp = (None if has_dropout(s.model)
                else torch.zeros(val.ro.batch.completion_ids.shape, dtype=update.logprob_dtype(s.model)))
    with hooks:
        val_pass = backward_per_sample(s, val.ro, val.ref_logp, step, with_entropy=False, record=val_logp)
        s.ranks.reduce_gradients(trainable(s.model))  # G_val of the whole validation batch
        hooks.capture_validation_gradient()
        # In AdamW's geometry only once it holds moments: on the first step its update is sign(gbar), whose
        # derivative in any sample's weight is ~0 (D_1 ~ eps/u^2), so its scores carry no ranking
        # (bench/influence_truth.py: there the sgd score ranks best)
        t = s.spec.tracin
        adam = t.geometry != "sgd" and bool(s.optimizer.state)
        along = adam_directions(s, hooks, moments="prior") if adam and not t.needs_batch_gradient else None
        t_val = time.perf_counter() - t0
        hooks.start_scoring(len(ro), "cpu", along=along,  # scored and folded as each micro-batch ends: prompts ahead
                            prompts=(ro.batch.prompt_ids, ro.batch.prompt_mask) if stream_positive else None)
        fold_positive = (lambda: hooks.fold(sel.positive(hooks.scores).double())) if stream_positive else None
        train_pass = backward_per_sample(s, ro, ref_logp, step, hooks, after_micro_batch=fold_positive)
        if adam and t.needs_batch_gradient:  # gbar is known now: rescore every sample in AdamW's geometry
            hooks.complete_gradient(len(ro))  # gbar is every row's gradient, the shared prompts' positions too
            hooks.rescore(adam_directions(s, hooks, moments=MOMENTS[t.geometry]))
    t1 = time.perf_counter()
    every = ro.gather(hooks.scores)
    chosen_all = select(s.spec, every, hooks, step, ro)
    return Scored(every=every, chosen_all=chosen_all, chosen=chosen_all[ro.positions], mine=hooks.scores.float(),
                  train_stats=train_pass.metrics(), time_s=t_val + time.perf_counter() - t1,
                  val_at_theta_t=None if val_logp is None else prediction.Objective(value=val_pass.loss,
                                                                                      logp=val_logp.to(s.device)))


def update_selected(run: skeleton.Run, ro: Rollouts[Any], scored: Scored, hooks: GhostHooks, old_logp: torch.Tensor | None,
                    ref_logp: torch.Tensor | None, step: int, *, streamed: bool) -> dict[str, float]:
    """5. The update on the selected samples only, each with the weight it has in the whole batch's
    loss (AdamW is invariant to a constant loss scale, so this is a definition, not a step size):
    with one epoch their gradient is recovered from the hooks, with more the epochs run on them."""
    s = of_kind(run.s, TracInJob)
    if not scored.n_selected:
        s.optimizer.zero_grad(set_to_none=True)
        run.reporter.event("no_selection", f"step {step}: no sample had positive influence; no update",
                           level="warning", data={"max_influence": float(scored.every.max())})
        return {}
    if s.spec.grpo.epochs_per_rollout_batch == 1:
        if not streamed:
            hooks.fold(scored.chosen.double())
        return apply_recovered_gradient(run, hooks)
    s.optimizer.zero_grad(set_to_none=True)
    rows = scored.chosen.nonzero().flatten().tolist()
    return update.train_epochs(run, ro, old_logp, ref_logp, step, rows=rows, norm_rows=list(range(len(ro))))


def baseline_step(run: skeleton.Run, ro: Rollouts[Any], step: int) -> tuple[dict[str, float], torch.Tensor]:
    """A baseline's update: plain GRPO epochs on the rows it keeps, each with its weight in the whole
    batch's loss. Returns the metrics and this rank's rows' selection."""
    s = of_kind(run.s, TracInJob)
    chosen = select_baseline(s, ro, step)[ro.positions]
    rows = chosen.nonzero().flatten().tolist()
    old_logp, ref_logp = update.old_logprobs(s, ro), update.reference_logprobs(s, ro.batch)
    s.optimizer.zero_grad(set_to_none=True)
    return update.train_epochs(run, ro, old_logp, ref_logp, step, rows=rows, norm_rows=list(range(len(ro)))), chosen


def influence_step(run: skeleton.Run, ro: Rollouts[Any], val: Validation, step: int) -> tuple[dict[str, float], Scored]:
    """2-6 on one step's rollouts: score, select, update, and check the prediction."""
    s = of_kind(run.s, TracInJob)
    t = s.spec.tracin
    one_epoch = s.spec.grpo.epochs_per_rollout_batch == 1
    streams = not t.needs_batch_gradient  # a sample's score is known as its micro-batch's backward ends
    stream_positive = one_epoch and t.selection == "positive" and streams
    old_logp = update.old_logprobs(s, ro)
    ref_logp = update.reference_logprobs(s, ro.batch)
    hooks = GhostHooks(s.model, keep_factors=one_epoch or not streams or t.selection in PAIRWISE)
    scored = score_and_select(s, ro, val, ref_logp, step, hooks, stream_positive=stream_positive)
    run.reporter.selection(selection_record(step, t.selection, scored.every.float(), scored.chosen_all))
    t_check = time.perf_counter()
    check = t.check_prediction and scored.n_selected > 0
    theta_t = (prediction.before_update(s, val.ro, val.ref_logp, hooks, known=scored.val_at_theta_t)
               if check and val.ro is not None else None)
    lr, t_check = float(s.scheduler.get_last_lr()[0]), time.perf_counter() - t_check
    metrics = {**scored.train_stats,
               **update_selected(run, ro, scored, hooks, old_logp, ref_logp, step, streamed=stream_positive)}
    if theta_t is not None and val.ro is not None:
        t1 = time.perf_counter()
        metrics.update(prediction.after_update(s, val.ro, val.ref_logp, hooks, theta_t, lr=lr, step=step,
                                               selected_influence=float(scored.every[scored.chosen_all].sum())))
        metrics["time/tracin_check_s"] = t_check + time.perf_counter() - t1
    hooks.release()
    metrics.update({"tracin/mean_ip": float(scored.every.mean()), "tracin/time_s": scored.time_s})
    return metrics, scored


def run(spec: TracInJob, reporter: Reporter, *, settings: Settings, ranks: Ranks = SINGLE) -> LoopResult:
    g, t = spec.grpo, spec.tracin
    seed_everything(g.seed)
    s = build(spec, settings, reporter, ranks=ranks)
    run = skeleton.start(s, reporter, partial(evaluation.evaluate, s))
    by_influence = t.selection not in BASELINES
    val = Validation()
    rollouts = TrainRollouts(s)  # with rollout.max_staleness 1, a step ahead
    for step in run.steps():
        if stopped := skeleton.stop_requested(run, step):
            return stopped
        timer = skeleton.begin_step(run, step)  # seed, sync the rollout copy from the policy
        try:
            ro = rollouts.collect(step, reporter)
        except Stopped as exc:  # a cancel heard between the step's episodes
            return skeleton.stopped_in_step(run, step, str(exc))
        val_stats = validation_batch(s, val, step, reporter) if by_influence else {}
        skeleton.rollouts_done(run, timer)
        if isinstance(ro, Tied):
            skeleton.skip_step(run, step, "every training group's rewards tied (no signal)",
                               {**val_stats, **ro.metrics(), "tracin/num_selected": 0.0}, timer=timer)
            continue
        n = ro.total
        if by_influence and val.ro is None:  # G_val = 0, so every influence is exactly 0 and nothing is selected
            mine = len(ro)
            reporter.selection(selection_record(step, t.selection, torch.zeros(n), torch.zeros(n, dtype=torch.bool)))
            skeleton.skip_step(run, step, "every validation group's rewards tied (no signal)",
                               {**ro.metrics(), **val_stats, "tracin/mean_ip": 0.0, "tracin/num_selected": 0.0,
                                "tracin/selection_ratio": 0.0}, timer=timer,
                               samples=ro.sample_rows(n if g.samples_per_step else 0, influence=[0.0] * mine,
                                                      selected=[False] * mine))
            continue
        t0 = time.perf_counter()
        if by_influence:
            metrics, scored = influence_step(run, ro, val, step)
            chosen, influence, n_selected = scored.chosen, scored.mine.tolist(), scored.n_selected
        else:
            metrics, chosen = baseline_step(run, ro, step)
            influence, n_selected = None, int(ro.ranks.sum({"n": float(chosen.sum())})["n"])
        timer.train_s = time.perf_counter() - t0
        metrics.update({**ro.metrics(), **val_stats, "tracin/num_selected": float(n_selected),
                        "tracin/selection_ratio": n_selected / n})
        skeleton.finish_step(run, step, metrics, timer=timer, tokens=float(ro.batch.completion_mask.sum()),
                             samples=ro.sample_rows(n if g.samples_per_step else 0, influence=influence,
                                                    selected=chosen.tolist()))
    return skeleton.finish(run)
