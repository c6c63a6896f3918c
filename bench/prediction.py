"""Why does TracIn's step prediction miss? Curvature or noise, over learning rates and precisions.

Runs the real TracIn loop (`tracin.check_prediction`, on by default) on `bench/specs/selection-arith.yaml`
for each learning rate x parameter dtype, each in its own `grpo-jobs run` process, and reads every
checked step's
    predicted_delta           <G_val(t), delta>                       first order
    predicted_delta_trapezoid 1/2 <G_val(t) + G_val(t+1), delta>      exact for a quadratic
    actual_delta              L_val(t+1) - L_val(t)
It reports each prediction's Pearson and Spearman correlation with the actual change (95% paired
bootstrap intervals) and its median relative error, beside the **noise floor**: how far L_val moves
with no update at all when the same validation batch is evaluated in other micro-batches (another
reduction order), as a share of the median |actual change|.

How to read it: if the first order misses and the trapezoid does not, the gap is the step's curvature
(it grows as lr^2 against the first order's lr); if both miss by about the noise floor, the step is
below what the arithmetic can resolve.

    python bench/prediction.py [--lrs 1e-5,3e-5,1e-4,3e-4] [--dtypes float32,float64] [--steps 30]

Ends with one RESULT line per run: RESULT lr=... dtype=... first_pearson=... trapezoid_pearson=...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import yaml
from learning import ROOT, run_seed  # bench/ is on the path when a bench runs

from service.core import evidence

SPEC = ROOT / "bench" / "specs" / "selection-arith.yaml"


def noise_floor(raw: dict) -> float:
    """|L_val(theta) in micro-batches of 1 - L_val(theta) in one micro-batch|, on a validation batch drawn
    as the loop draws it, with no update in between."""
    from service.core.settings import get_settings
    from service.core.specs import TracInJob
    from worker.loops import prediction, tracin
    from worker.loops.setup import build
    from worker.reporting import FileReporter
    from worker.training import seed_everything

    spec = TracInJob.model_validate(raw)
    reporter = FileReporter(Path(tempfile.mkdtemp(prefix="grpo-bench-noise-")))
    seed_everything(spec.grpo.seed)
    s = build(spec, get_settings(), reporter)
    val = tracin.Validation()
    for step in range(1, 6):  # the first step whose validation groups are not all tied
        tracin.validation_batch(s, val, step, reporter)
        if val.ro is not None:
            break
    if val.ro is None:
        return float("nan")
    at = prediction.objective(s, val.ro, None, val.ref_logp)
    whole, logp = at.value, at.logp
    one_by_one = dataclasses.replace(s, spec=spec.model_copy(update={
        "grpo": spec.grpo.model_copy(update={"micro_batch_size": 1})}))
    # the ratios' denominators are the same in both: the whole-batch pass's log-probs
    single = prediction.objective(one_by_one, val.ro, logp, val.ref_logp).value
    return abs(single - whole)


@dataclasses.dataclass(frozen=True)
class Row:
    """One run's check, over its steps."""

    lr: float
    dtype: str
    steps: int
    first: evidence.Correlation  # first order against actual
    trapezoid: evidence.Correlation
    first_err: float  # median |predicted - actual| / |actual|
    trapezoid_err: float
    median_actual: float  # median |actual|
    floor_ratio: float  # the noise floor / median_actual


def fmt(iv: evidence.Interval | None) -> str:
    return "–" if iv is None else f"{iv.estimate:+.2f} [{iv.low:+.2f}, {iv.high:+.2f}]"


def median_rel(pred: list[float], act: list[float]) -> float:
    return statistics.median(abs(p - a) / abs(a) for p, a in zip(pred, act) if a != 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lrs", default="1e-5,3e-5,1e-4,3e-4")
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=None, help="prompts a step (the spec's: 4)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="(the spec's: 24)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    base = yaml.safe_load(SPEC.read_text())
    base["grpo"].update({"steps": args.steps, "eval_every": 0, "eval_prompts": 1})
    if args.prompts:
        base["grpo"]["prompts_per_step"] = args.prompts
    if args.max_new_tokens:
        base["grpo"]["max_new_tokens"] = args.max_new_tokens
    base["tracin"]["check_prediction"] = True
    work = Path(tempfile.mkdtemp(prefix="grpo-bench-prediction-"))
    print(f"{base['model']['name']}, {args.steps} steps of {base['grpo']['prompts_per_step']} x "
          f"{base['grpo']['num_generations']} completions, validation {base['tracin']['val_prompts']} x "
          f"{base['tracin']['val_generations']}; work in {work}")
    floors = {}
    rows = []
    for dtype in args.dtypes.split(","):
        raw = json.loads(json.dumps(base))
        raw["model"]["dtype"] = dtype
        raw["grpo"]["seed"] = args.seed
        floors[dtype] = noise_floor(raw)
        for lr in (float(x) for x in args.lrs.split(",")):
            raw["grpo"]["learning_rate"] = lr
            run = run_seed(raw, args.seed, code=ROOT, threads=args.threads, work=work, tag=f"{dtype}-{lr:g}-")
            lines = [json.loads(x) for x in (work / f"{dtype}-{lr:g}-seed-{args.seed}" / "metrics.jsonl")
                     .read_text().splitlines()]
            m = [x["metrics"] for x in lines if "tracin/actual_delta" in x["metrics"]]
            act = [x["tracin/actual_delta"] for x in m]
            first = [x["tracin/predicted_delta"] for x in m]
            trap = [x["tracin/predicted_delta_trapezoid"] for x in m]
            c1, c2 = evidence.correlation(first, act), evidence.correlation(trap, act)
            med_act = statistics.median(abs(a) for a in act) if act else float("nan")
            rows.append(Row(lr, dtype, len(act), c1, c2, median_rel(first, act) if act else float("nan"),
                            median_rel(trap, act) if act else float("nan"), med_act, floors[dtype] / med_act))
            print(f"lr {lr:g} {dtype}: {len(act)} checked steps in {run.wall_s:.0f} s", flush=True)

    print("\n| lr | dtype | steps | first order: Pearson | first order: Spearman | trapezoid: Pearson | "
          "trapezoid: Spearman | median rel. error, first / trapezoid | median abs(actual) | noise floor / it |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r.lr:g} | {r.dtype} | {r.steps} | {fmt(r.first.pearson)} | {fmt(r.first.spearman)} | "
              f"{fmt(r.trapezoid.pearson)} | {fmt(r.trapezoid.spearman)} | {r.first_err:.3f} / {r.trapezoid_err:.3f} | "
              f"{r.median_actual:.2e} | {r.floor_ratio:.1e} |")
    for r in rows:
        p1 = r.first.pearson.estimate if r.first.pearson else float("nan")
        p2 = r.trapezoid.pearson.estimate if r.trapezoid.pearson else float("nan")
        print(f"RESULT lr={r.lr:g} dtype={r.dtype} steps={r.steps} first_pearson={p1:.3f} trapezoid_pearson={p2:.3f} "
              f"first_rel_err={r.first_err:.3f} trapezoid_rel_err={r.trapezoid_err:.3f} "
              f"noise_floor_ratio={r.floor_ratio:.1e}")


if __name__ == "__main__":
    main()
