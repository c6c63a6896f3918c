"""Does choosing prompts pay for itself, and on which cost axis? Held-out accuracy against four costs:
training steps, rollouts (completions sampled, refills included), generated tokens and wall-clock seconds,
over paired seeds, for five arms:

- `uniform`: prompts drawn uniformly (plain GRPO);
- `refill`: uniform, with tied groups dropped after sampling and refilled (`grpo.drop_zero_std_groups`);
- `learnability`: prompts drawn before sampling by the predicted chance of a group with a signal
  (`selection.prompts: learnability`);
- `tracin`: TracIn keeping the samples with positive influence (`tracin.selection: positive`);
- `learnability+tracin`: both.

The task is bench/selection_noisy.py's (sums of 2-4 one-digit numbers; its small base model, pass rates
spread over (0, 1)), with clean labels by default and a small pool of training prompts (--train), so that
a prompt comes back and what the draw learned of it can be used. Every arm of a seed starts from the same
weights (the fingerprint's trainable_sha256, checked). Test accuracy is measured outside the jobs on the
checkpoints every --eval-every steps.

How arms are compared on an axis: on each seed, the budget is the least any arm spent in all (so every arm
reached it); each arm's accuracy at that budget is read off its test curve against its cumulative cost
(linear between checkpoints), and its area under that curve up to the budget is divided by the budget.
Both are paired against `uniform` on the same seed, with a 95% Student-t interval over seeds.

    python bench/selection.py                          # 12 seeds, 50 steps, every arm (about 20 min on 2 cores)
    python bench/selection.py --short                  # 2 seeds, 4 steps, an untrained base: the CI check
    python bench/selection.py --environment            # the same study on episodes (after `make openenv`; about 40 min)

`--environment` plays the task as an agent environment instead of a dataset: bench/sums_env.py serves the
same rows over OpenEnv with its Task API (a unit of the draw is a training row's task), and an episode has
a second turn after a wrong answer (told "Wrong." and asked again; 0.5 for a right second answer, 1 for a
right first one). The jobs run `environment.url` with `environment.tasks`, as a user's agent job on their
own server would; its base model is trained on the episode's first prompt (the question and a newline,
as a model with no chat template reads an observation), and test accuracy is its greedy first turn.

A benchmark, never a test. Ends with one line per arm and axis:
RESULT axis=... arm=... seeds=... spent=... acc=... diff=... lo=... hi=... auc_diff=... auc_lo=... auc_hi=...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from learning import ROOT  # bench/ is on the path
from selection_noisy import (
    MODEL,
    Task,
    lines,
    prepare,
    run_job,
    study_arguments,
    study_spec,
    test_curve,
)

from service.core import evidence
from worker.environments.servers import BundledServer

ARMS = {  # arm -> (job kind, what it adds to the spec)
    "uniform": ("grpo", {}),
    "refill": ("grpo", {"grpo": {"drop_zero_std_groups": True, "max_refill_rounds": 1}}),
    "learnability": ("grpo", {"selection": {"prompts": "learnability"}}),
    "tracin": ("tracin", {"tracin": {"selection": "positive"}}),
    "learnability+tracin": ("tracin", {"selection": {"prompts": "learnability"}, "tracin": {"selection": "positive"}}),
}
AXES = {  # axis -> the per-step metric it adds up (None: one a step)
    "steps": None,
    "rollouts": "selection/rollouts",
    "tokens": "selection/generated_tokens",
    "seconds": "time/step_s",
}


def arm_spec(args: argparse.Namespace, arm: str) -> dict:
    kind, extra = ARMS[arm]
    spec = study_spec(args, kind, f"selection-{arm}", samples_per_step=0)
    if args.environment:  # the rows as tasks of bench/sums_env.py's server: no dataset, the episode's reward
        del spec["dataset"], spec["rewards"]
        spec["environment"] = {"url": args.env_url, "tasks": {"train": "train", "eval": "val"}, "max_turns": 2,
                               "max_episode_tokens": 64, "max_observation_tokens": 40, "eval_episodes": 8}
    if kind == "tracin":
        spec["tracin"] = {"val_prompts": args.val_prompts, "val_generations": 4, "val_regenerate_every": 1,
                          "check_prediction": False}
    for section, values in extra.items():
        spec[section] = {**spec.get(section, {}), **values}
    return spec


@dataclass(frozen=True)
class Run:
    """One arm on one seed: its test curve and what each step cost."""

    arm: str
    seed: int
    curve: dict[int, float]  # step -> test accuracy (step 0: the base model's)
    costs: dict[str, list[float]]  # axis -> [steps] cumulative cost after each step
    signal: float  # mean selection/observed_signal: the share of groups whose rewards differ
    start_sha256: str

    def spent(self, axis: str) -> float:
        return self.costs[axis][-1]

    def at(self, axis: str, budget: float) -> tuple[float, float]:
        """Accuracy at `budget` of `axis` and the mean accuracy over [0, budget] (linear between checkpoints)."""
        xs = [0.0] + [self.costs[axis][s - 1] for s in sorted(self.curve) if s > 0]
        ys = [self.curve[s] for s in sorted(self.curve)]
        area, x0, y0 = 0.0, xs[0], ys[0]
        for x1, y1 in zip(xs[1:], ys[1:]):
            if x1 >= budget:
                y_b = y0 + (y1 - y0) * (budget - x0) / (x1 - x0) if x1 > x0 else y1
                return y_b, (area + (budget - x0) * (y0 + y_b) / 2) / budget
            area += (x1 - x0) * (y0 + y1) / 2
            x0, y0 = x1, y1
        return y0, (area + (budget - x0) * y0) / budget  # the budget is this run's whole spend: x0 == budget


def run_arm(args: argparse.Namespace, arm: str, seed: int, task: Task, base_acc: float) -> Run:
    out, _ = run_job(args, arm_spec(args, arm), f"{arm}-seed-{seed}", seed)
    steps = [m for m in lines(out / "metrics.jsonl") if m["step"] > 0 and "selection/rollouts" in m["metrics"]]
    costs = {}
    for axis, key in AXES.items():
        total, cum = 0.0, []
        for m in steps:
            total += 1.0 if key is None else m["metrics"][key]
            cum.append(total)
        costs[axis] = cum
    [fp] = [e["data"] for e in lines(out / "events.jsonl") if e["type"] == "fingerprint"]
    signal = statistics.fmean(m["metrics"]["selection/observed_signal"] for m in steps)
    return Run(arm, seed, test_curve(args, out, task, base_acc), costs, signal, fp.get("trainable_sha256", ""))


def fmt(i: evidence.Interval | None) -> str:
    return "–" if i is None else f"{i.estimate:+.3f} [{i.low:+.3f}, {i.high:+.3f}]"


def report(runs: dict[str, dict[int, Run]], seeds: list[int], args: argparse.Namespace, base_acc: float) -> None:
    same = [s for s in seeds if len({runs[a][s].start_sha256 for a in runs}) == 1 and runs["uniform"][s].start_sha256]
    played = "tasks of bench/sums_env.py (episodes of up to 2 turns)" if args.environment else "rows"
    print(f"\n{len(seeds)} paired seeds, {args.steps} steps, {args.prompts} prompts x 8 a step, {args.train} training "
          f"{played}, {args.noise:.0%} wrong answers; base model's test accuracy {base_acc:.3f} on {args.test} rows")
    print(f"starting weights identical across arms on {len(same)} of {len(seeds)} seeds (fingerprint trainable_sha256)",
          flush=True)
    print("\nwhat each arm spent in all, mean over seeds (against uniform's), and its share of groups with a signal")
    print(f"{'arm':<21}" + "".join(f"{a:<20}" for a in AXES) + "signal")
    for arm in runs:
        cells = []
        for axis in AXES:
            mine = statistics.fmean(runs[arm][s].spent(axis) for s in seeds)
            base = statistics.fmean(runs["uniform"][s].spent(axis) for s in seeds)
            cells.append(f"{mine:,.0f} ({mine / base:.2f}x)".ljust(20))
        print(f"{arm:<21}" + "".join(cells) + f"{statistics.fmean(runs[arm][s].signal for s in seeds):.2f}")
    results = []
    for axis in AXES:
        budget = {s: min(runs[a][s].spent(axis) for a in runs) for s in seeds}
        print(f"\naxis: {axis} (budget per seed: the least any arm spent; mean {statistics.fmean(budget.values()):,.0f})")
        print(f"{'arm':<21}{'acc at budget':<17}{'vs uniform [95% CI]':<27}{'mean acc to budget':<20}vs uniform [95% CI]")
        for arm in runs:
            acc = [runs[arm][s].at(axis, budget[s]) for s in seeds]
            base = [runs["uniform"][s].at(axis, budget[s]) for s in seeds]
            d = evidence.mean_interval([a[0] - b[0] for a, b in zip(acc, base)]) if arm != "uniform" else None
            da = evidence.mean_interval([a[1] - b[1] for a, b in zip(acc, base)]) if arm != "uniform" else None
            m, se = statistics.fmean(a[0] for a in acc), evidence.standard_error([a[0] for a in acc])
            print(f"{arm:<21}{m:.3f} ± {se:.3f}    {fmt(d):<27}{statistics.fmean(a[1] for a in acc):.3f}"
                  f"{'':<15}{fmt(da)}")
            results.append((axis, arm, m, d, da, statistics.fmean(runs[arm][s].spent(axis) for s in seeds)))
    nan = evidence.Interval(float("nan"), float("nan"), float("nan"))
    for axis, arm, m, d, da, spent in results:
        d, da = d or nan, da or nan
        print(f"RESULT axis={axis} arm={arm} seeds={len(seeds)} spent={spent:.1f} acc={m:.3f} diff={d.estimate:+.3f} lo={d.low:+.3f} "
              f"hi={d.high:+.3f} auc_diff={da.estimate:+.3f} auc_lo={da.low:+.3f} auc_hi={da.high:+.3f}", flush=True)


class SumsServer(BundledServer):
    """bench/sums_env.py, started, awaited and stopped as the worker's own environment servers are."""

    def __init__(self, data: Path, log_path: Path, *, python: Path) -> None:
        super().__init__("sums", log_path, python=python)
        self.data = data

    def argv(self) -> list[str]:
        return [str(self.python), str(ROOT / "bench" / "sums_env.py"), "--data", str(self.data), "--port",
                str(self.port)]


@contextlib.contextmanager
def sums_server(args: argparse.Namespace) -> Iterator[str]:
    """bench/sums_env.py on a free loopback port, serving args.work's rows, for as long as the study runs; its
    URL, on the jobs' allow-list (GRPO_ENVIRONMENT_URLS)."""
    python = Path(os.environ.get("GRPO_OPENENV_PYTHON") or ROOT / ".venv-openenv" / "bin" / "python")
    if not python.exists():
        raise SystemExit(f"--environment needs OpenEnv's current release ({python} is not there): run `make openenv`")
    server = SumsServer(args.work / "data", args.work / "sums-env.log", python=python)
    url = server.start()
    try:
        os.environ["GRPO_ENVIRONMENT_URLS"] = url  # the jobs' processes inherit it
        yield url
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # a small pool of training rows: 50 steps x 8 prompts draw each about 3 times
    study_arguments(ap, noise=0.0, train=128, work=Path("/tmp/selection-axes"))
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated; `uniform` is always run")
    ap.add_argument("--short", action="store_true", help="2 seeds, 4 steps, 32 rows, an untrained base model")
    ap.add_argument("--environment", action="store_true", help="the rows as an agent environment's tasks "
                    "(bench/sums_env.py, two turns), in /tmp/selection-episodes unless --work says otherwise")
    args = ap.parse_args()
    if args.short:
        args.seeds, args.steps, args.eval_every, args.prompts, args.val_prompts = 2, 4, 2, 4, 2
        args.train, args.val, args.test, args.base_acc = 32, 8, 50, 0.0
    if args.environment:
        args.model, args.prompt_suffix = f"{MODEL}-episodes", "\n"
        if args.work == Path("/tmp/selection-axes"):
            args.work = Path("/tmp/selection-episodes")
    task, base_acc = prepare(args)
    with contextlib.ExitStack() as stack:
        args.env_url = stack.enter_context(sums_server(args)) if args.environment else None
        study(args, task, base_acc)


def study(args: argparse.Namespace, task: Task, base_acc: float) -> None:
    arms = [a for a in ARMS if a in set(args.arms.split(",")) | {"uniform"}]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    runs: dict[str, dict[int, Run]] = {a: {} for a in arms}

    def run(arm_seed: tuple[str, int]) -> None:
        arm, seed = arm_seed
        r = runs[arm][seed] = run_arm(args, arm, seed, task, base_acc)
        print(f"  {arm:<20} seed {seed}: test acc {r.curve[0]:.3f} -> {r.curve[max(r.curve)]:.3f}, "
              f"{r.spent('rollouts'):.0f} rollouts, {r.spent('tokens'):.0f} tokens, {r.spent('seconds'):.0f} s",
              flush=True)

    with ThreadPoolExecutor(args.parallel) as pool:  # seed by seed: the arms of a seed run under like load
        list(pool.map(run, [(a, s) for s in seeds for a in arms]))
    report(runs, seeds, args, base_acc)


if __name__ == "__main__":
    main()
