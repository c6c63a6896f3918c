"""Does selecting training samples beat training on all of them? Every `tracin.selection` over paired
seeds: for each seed, every mode runs the same spec with the same grpo.seed (the same prompts, the same
per-row sampling streams, the same LoRA initialisation), so the modes differ only in which samples
each step trains on. Prints, per mode:

  - held-out greedy `eval/accuracy` at the last step: mean ± standard error over seeds;
  - its paired difference against `all` (uniform GRPO) with a 95% Student-t interval over seeds;
  - the mean step time as a ratio to `all`'s (time/step_s, same seed, same machine);
  - the mean share of samples kept.

`positive` runs first on each seed; every mode that keeps a fraction (random, top_fraction,
top_cosine, greedy, pass_rate) keeps the share `positive` kept on that seed (its mean
tracin/selection_ratio), so "random" is random at the same ratio and the others rank at equal count.

    python bench/selection_modes.py                                     # 6 seeds, every mode (hours on 2 cores)
    python bench/selection_modes.py --seeds 3 --modes positive,random,all --parallel 2 --threads 1

Each run is its own `grpo-jobs run` process (bench/learning.py's run_seed). A benchmark, never a test.
Ends with one line per mode: RESULT mode=... seeds=... acc_mean=... acc_se=... diff=... lo=... hi=... step_ratio=...
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml
from learning import ROOT, SeedRun, run_seed  # bench/ is on the path when a bench runs

from service.core import evidence

SPEC = ROOT / "bench" / "specs" / "selection-arith.yaml"
MODES = ("positive", "top_fraction", "top_cosine", "greedy", "random", "pass_rate", "all")
INFLUENCE = ("positive", "top_fraction", "top_cosine", "greedy")
VALIDATION = ("val_prompts", "val_generations", "val_regenerate_every", "check_prediction")


def mode_spec(spec: dict, mode: str, fraction: float | None) -> dict:
    """The spec with tracin.selection = mode (the validation settings only where influence is computed)."""
    tracin = {k: v for k, v in (spec.get("tracin") or {}).items() if mode in INFLUENCE or k not in VALIDATION}
    tracin["selection"] = mode
    tracin.pop("fraction", None)
    if mode not in ("positive", "all"):
        tracin["fraction"] = round(min(1.0, max(fraction or 0.5, 0.01)), 3)
    return {**spec, "tracin": tracin}


@dataclass(frozen=True)
class ModeSummary:
    """One mode over the paired seeds, against `all` on the same seeds."""

    mode: str
    acc_mean: float
    acc_se: float
    diff: evidence.Interval  # accuracy minus `all`'s, paired by seed (nan with one seed)
    step_ratio: float  # mean over seeds of time/step_s / `all`'s
    kept: float  # mean tracin/selection_ratio


def summarise(mode: str, runs: dict[int, SeedRun], base: dict[int, SeedRun], seeds: list[int],
              last: int) -> ModeSummary:
    acc = [runs[s].accuracy[last] for s in seeds]
    nan = float("nan")
    diff = evidence.mean_interval([runs[s].accuracy[last] - base[s].accuracy[last] for s in seeds])
    return ModeSummary(
        mode, statistics.fmean(acc), evidence.standard_error(acc), diff or evidence.Interval(nan, nan, nan),
        statistics.fmean(runs[s].means["time/step_s"] / base[s].means["time/step_s"] for s in seeds),
        statistics.fmean(runs[s].means.get("tracin/selection_ratio", nan) for s in seeds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, default=SPEC, help="a kind: tracin spec")
    ap.add_argument("--seeds", type=int, default=6, help="paired seeds")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="override grpo.steps (0: the spec's)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated; `all` is always run")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once")
    ap.add_argument("--threads", type=int, default=0, help="threads per run (default: cores / parallel)")
    args = ap.parse_args()
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.parallel)
    spec = yaml.safe_load(args.spec.read_text())
    if args.steps:
        spec["grpo"]["steps"] = args.steps
    last = spec["grpo"]["steps"]
    modes = [m for m in MODES if m in set(args.modes.split(",")) | {"all"}]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    runs: dict[str, dict[int, SeedRun]] = {m: {} for m in modes}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        def run(mode: str, seed: int, fraction: float | None) -> None:
            runs[mode][seed] = run_seed(mode_spec(spec, mode, fraction), seed, code=ROOT, threads=threads,
                                        work=Path(tmp), tag=f"{mode}-")
            r = runs[mode][seed]
            print(f"  {mode:<12} seed {seed}: acc {r.accuracy.get(0, float('nan')):.3f} -> "
                  f"{r.accuracy.get(last, float('nan')):.3f}, {r.wall_s:.0f} s", flush=True)

        matched: dict[int, float | None] = {s: None for s in seeds}
        if "positive" in modes:
            list(pool.map(lambda s: run("positive", s, None), seeds))
            matched = {s: runs["positive"][s].means.get("tracin/selection_ratio") for s in seeds}
        rest = [(m, s) for m in modes if m != "positive" for s in seeds]
        list(pool.map(lambda ms: run(ms[0], ms[1], matched[ms[1]]), rest))

    base = runs["all"]
    summaries = [summarise(mode, runs[mode], base, seeds, last) for mode in modes]
    print(f"\n{args.spec.name}: {len(seeds)} paired seeds, {last} steps, eval/accuracy on "
          f"{spec['grpo'].get('eval_prompts', 32)} held-out prompts at step {last}")
    print(f"{'mode':<13}{'acc mean ± se':<17}{'vs all: diff [95% CI]':<30}{'step time / all':<17}kept")
    for m in summaries:
        d = m.diff
        ci = "–" if m.mode == "all" else f"{d.estimate:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
        print(f"{m.mode:<13}{m.acc_mean:.3f} ± {m.acc_se:.3f}    {ci:<30}{m.step_ratio:<17.2f}{m.kept:.2f}")
    for m in summaries:
        d = m.diff
        print(f"RESULT mode={m.mode} seeds={len(seeds)} acc_mean={m.acc_mean:.3f} acc_se={m.acc_se:.3f} "
              f"diff={d.estimate:+.3f} lo={d.low:+.3f} hi={d.high:+.3f} step_ratio={m.step_ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
