"""Which influence score predicts what a sample actually does to an AdamW step? Ground truth, measured.

For each step of a real run (SmolLM2-135M with LoRA on the arithmetic task, the spec of
`bench/specs/selection-arith.yaml`), with the step's training batch of N completions and its
validation batch:

1. score every sample four ways from one backward with the ghost hooks (worker/algos/influence.py):
   `sgd` <g_i, G_val>, `adam_fixed_state` <g_i, (a_t/u) G_val> (the LESS preconditioner), `adam`
   <g_i, D_t G_val> (D_t with its moment term) and `adam_prior_state` <g_i, (a_t/u_{t-1}) G_val> (the
   preconditioner from the moments before the step alone), exactly as `tracin.score` does in a job;
2. redo the step's real AdamW update (clipping included) from the same weights and optimizer state on
   the batch without sample i, for every i, and on random halves of the batch, and measure the actual
   change of the validation objective L_val against the full batch's update;
3. correlate each score's prediction (dropping i raises L_val by lr * score_i to first order; a half
   by the sum over it) with the actual change: Pearson and Spearman with 95% paired bootstrap
   intervals over the pooled points (service/core/evidence.py), and how often the sign is right.

The run then takes the full batch's step and moves on, so the optimizer state grows as in a job. Step
1 is Adam's sign step (m = v = 0: D_1 ~ 0, no one sample changes it); it is reported apart.

    python bench/influence_truth.py [--steps 5] [--lr 3e-4] [--dtype float32] [--halves 16]

Ends with one RESULT line per score: RESULT score=adam drop_spearman=... half_spearman=...
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from service.core import evidence
from service.core.settings import get_settings
from service.core.specs import TracInJob
from worker.algos.influence import GhostHooks
from worker.loops import prediction, tracin, update
from worker.loops.setup import build
from worker.loops.sources import TrainRollouts
from worker.reporting import FileReporter
from worker.training import seed_everything, step_seed, trainable

SCORES = ("sgd", "adam_fixed_state", "adam", "adam_prior_state")
SPEC = Path(__file__).parent / "specs" / "selection-arith.yaml"


@dataclass
class Points:
    """Predicted (lr * score, summed over what is dropped) and actual changes of L_val, per step."""

    predicted: dict[str, list[list[float]]] = field(default_factory=lambda: {k: [] for k in SCORES})
    actual: list[list[float]] = field(default_factory=list)

    def new_step(self) -> None:
        self.actual.append([])
        for k in SCORES:
            self.predicted[k].append([])

    def add(self, actual: float, predicted: dict[str, float]) -> None:
        self.actual[-1].append(actual)
        for k in SCORES:
            self.predicted[k][-1].append(predicted[k])

    def pooled(self, k: str | None) -> list[float]:
        """Score k's predictions (None: the actual changes) over every step, each step divided by its
        root mean square: steps differ in scale (the learning rate, the moments) and a correlation
        pooled over raw values would mostly say which steps were large."""
        out = []
        for xs in self.actual if k is None else self.predicted[k]:
            rms = (sum(x * x for x in xs) / len(xs)) ** 0.5 or 1.0
            out += [x / rms for x in xs]
        return out


def per_sample_gradients(hooks: GhostHooks) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Every LoRA weight's per-sample gradients [N, numel], from the factors the hooks kept."""
    n = hooks.scores.numel()
    out: dict[torch.nn.Parameter, torch.Tensor] = {}
    for i, rows, which, per in hooks.factors:
        layer = hooks.layers[i]
        p = layer.a.weight if which == "A" else layer.b.weight
        if p not in out:
            out[p] = torch.zeros(n, p.numel(), dtype=per.dtype)
        out[p][rows] = per.reshape(len(rows), -1)
    return out


class Replay:
    """The step's AdamW update from one saved state, on any reweighting of the batch."""

    def __init__(self, s, grads: dict[torch.nn.Parameter, torch.Tensor]):
        self.s, self.grads = s, grads
        self.params = trainable(s.model)
        self.theta = [p.detach().clone() for p in self.params]
        self.state = copy.deepcopy(s.optimizer.state_dict())

    def step(self, weights: torch.Tensor) -> None:
        """Weights back to theta_t, the optimizer's moments back, then its real step (clipped) on sum_i w_i g_i."""
        s = self.s
        with torch.no_grad():
            for p, t in zip(self.params, self.theta):
                p.copy_(t)
        s.optimizer.load_state_dict(copy.deepcopy(self.state))
        for p in self.params:
            g = self.grads.get(p)
            p.grad = torch.zeros_like(p) if g is None else (weights.to(g.dtype) @ g).view_as(p).to(p.dtype)
        update.clip_and_step(self.params, s.optimizer, None, max_norm=s.spec.train.max_grad_norm, ranks=s.ranks)
        s.optimizer.zero_grad(set_to_none=True)


def measure_step(s, ro, val, step: int, lr: float, halves: int, gen: torch.Generator,
                 drops: Points, parts: Points) -> dict[str, float]:
    """Scores, the actual changes, and the full batch's step taken at the end. Returns timings."""
    t = {}
    hooks = GhostHooks(s.model, keep_factors=True)
    old_logp = update.old_logprobs(s, ro)
    ref_logp = update.reference_logprobs(s, ro.batch)
    s.model.train()
    s.optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with hooks:
        tracin.backward_per_sample(s, val.ro, val.ref_logp, step, with_entropy=False)
        hooks.capture_validation_gradient()
        hooks.start_scoring(len(ro), "cpu")
        tracin.backward_per_sample(s, ro, ref_logp, step, hooks)
    t["score_sgd_s"] = time.perf_counter() - t0
    scores = {"sgd": hooks.scores.clone()}
    for name in SCORES[1:]:
        if name == "adam_prior_state" and not s.optimizer.state:
            scores[name] = scores["sgd"]  # as a job scores its first step: there are no moments before it
            continue
        t1 = time.perf_counter()
        scores[name] = hooks.rescore(tracin.adam_directions(s, hooks, moments=tracin.MOMENTS[name])).clone()
        t[f"rescore_{name}_s"] = time.perf_counter() - t1
    grads = per_sample_gradients(hooks)
    hooks.release()
    s.optimizer.zero_grad(set_to_none=True)
    del old_logp

    at = prediction.objective(s, val.ro, None, val.ref_logp)
    before, before_logp = at.value, at.logp
    replay = Replay(s, grads)
    n = len(ro)

    def actual(weights: torch.Tensor) -> float:
        replay.step(weights)
        return prediction.objective(s, val.ro, before_logp, val.ref_logp).value

    t2 = time.perf_counter()
    ones = torch.ones(n, dtype=torch.float64)
    full = actual(ones)
    drops.new_step()
    parts.new_step()
    for i in range(n):
        w = ones.clone()
        w[i] = 0.0
        drops.add(actual(w) - full, {k: lr * float(scores[k][i]) for k in SCORES})
    for _ in range(halves):
        dropped = torch.randperm(n, generator=gen)[: n // 2]
        w = ones.clone()
        w[dropped] = 0.0
        parts.add(actual(w) - full, {k: lr * float(scores[k][dropped].sum()) for k in SCORES})
    t["truth_s"] = time.perf_counter() - t2
    replay.step(ones)  # the run goes on with the full batch's step
    s.scheduler.step()
    t["val_objective"] = before
    t["full_delta"] = full - before
    return t


def fmt(iv: evidence.Interval | None) -> str:
    return "–" if iv is None else f"{iv.estimate:+.2f} [{iv.low:+.2f}, {iv.high:+.2f}]"


def sign_agreement(pred: list[float], act: list[float]) -> float:
    return sum((p > 0) == (a > 0) for p, a in zip(pred, act)) / max(1, len(act))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--halves", type=int, default=16, help="random halves of the batch dropped per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="another model than the spec's (e.g. tiny-random-llama to try it)")
    args = ap.parse_args()

    raw = yaml.safe_load(SPEC.read_text())
    raw["grpo"].update({"steps": args.steps, "learning_rate": args.lr, "seed": args.seed, "eval_every": 0})
    raw["model"]["dtype"] = args.dtype
    raw["tracin"]["val_regenerate_every"] = 1
    # one forward per row: the replayed update is built from each sample's own LoRA factors, which hold no part
    # of a shared prompt's positions (the scores' sharing is exact, tests/worker/loops/test_tracin.py)
    raw["grpo"]["share_prompts"] = False
    if args.model:
        raw["model"]["name"] = args.model
    spec = TracInJob.model_validate(raw)
    out = Path(tempfile.mkdtemp(prefix="grpo-bench-influence-"))
    reporter = FileReporter(out)
    seed_everything(spec.grpo.seed)
    s = build(spec, get_settings(), reporter)
    rollouts, val = TrainRollouts(s), tracin.Validation()
    gen = torch.Generator().manual_seed(args.seed)
    first, later = (Points(), Points()), (Points(), Points())
    print(f"{spec.model.name} {args.dtype}, LoRA r={spec.model.lora.r}, lr {args.lr}, "
          f"{spec.grpo.prompts_per_step} x {spec.grpo.num_generations} completions a step, "
          f"validation {spec.tracin.val_prompts} x {spec.tracin.val_generations}, {args.halves} halves a step")
    for step in range(1, args.steps + 1):
        seed_everything(step_seed(spec.train.seed, step))
        s.engine.sync(s.model)
        ro = rollouts.collect(step, reporter)
        tracin.validation_batch(s, val, step, reporter)
        if ro is None or val.ro is None:
            print(f"step {step}: every group tied; no update")
            continue
        drops, parts = first if step == 1 else later
        t = measure_step(s, ro, val, step, s.scheduler.get_last_lr()[0], args.halves, gen, drops, parts)
        print(f"step {step}: N={len(ro)}, L_val {t['val_objective']:+.5f}, full step's change "
              f"{t['full_delta']:+.2e}; scoring {t['score_sgd_s']:.1f} s (+{t['rescore_adam_s']:.2f} s adam), "
              f"ground truth {t['truth_s']:.0f} s", flush=True)

    for title, (drops, parts) in (("step 1 (Adam's sign step)", first), (f"steps 2-{args.steps}", later)):
        if not drops.actual:
            continue
        act_one, act_half = drops.pooled(None), parts.pooled(None)
        print(f"\n{title}: {len(act_one)} single-sample drops, {len(act_half)} half-batch drops (each step "
              "scaled by its RMS)")
        print("| score | drop one: Pearson | drop one: Spearman | sign right | drop half: Pearson | "
              "drop half: Spearman | sign right |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for k in SCORES:
            pred_one, pred_half = drops.pooled(k), parts.pooled(k)
            one, half = evidence.correlation(pred_one, act_one), evidence.correlation(pred_half, act_half)
            print(f"| `{k}` | {fmt(one.pearson)} | {fmt(one.spearman)} | {sign_agreement(pred_one, act_one):.2f} | "
                  f"{fmt(half.pearson)} | {fmt(half.spearman)} | {sign_agreement(pred_half, act_half):.2f} |")
            if title.startswith("steps"):
                print(f"RESULT score={k} drop_pearson={one.pearson.estimate if one.pearson else float('nan'):.3f} "
                      f"drop_spearman={one.spearman.estimate if one.spearman else float('nan'):.3f} "
                      f"half_spearman={half.spearman.estimate if half.spearman else float('nan'):.3f}", flush=True)
        for k in SCORES[1:]:  # the same points resampled together: is the Adam-aware ranking better?
            print(f"Spearman({k}) - Spearman(sgd): drop one {fmt(spearman_gain(drops, k))}, "
                  f"drop half {fmt(spearman_gain(parts, k))}")


def spearman_gain(points: Points, k: str) -> evidence.Interval | None:
    return evidence.spearman_difference(points.pooled(k), points.pooled("sgd"), points.pooled(None))


if __name__ == "__main__":
    main()
