"""Does a spec learn, over many seeds? Runs `grpo-jobs run` once per seed (grpo.seed: the prompt
order, the per-row sampling streams and the LoRA initialisation) and prints each seed's greedy
held-out `eval/accuracy` (an agent spec's: `eval/reward_mean`) at steps 0, 5 and 10 (or whatever steps the
spec evaluates at), its mean
training `reward/mean`, and the mean ± standard error over seeds.

    python bench/learning.py                                   # the demo spec and the matched spec, 6 seeds
    python bench/learning.py --spec examples/demo-smollm2.yaml --seeds 3 --steps 6
    python bench/learning.py --code ../other-checkout          # the same specs run by another checkout's code
    python bench/learning.py --parallel 2                      # two seeds at once, one thread each
    python bench/learning.py --dtype auto --parallel 2         # each seed in float32 (or the spec's dtype) and in auto, paired
    python bench/learning.py --dtype auto --fp32-head          # ... with auto's LM head multiplying in float32
    python bench/learning.py --dtype auto --eval-float32       # ... and auto's adapters evaluated in float32 too
    python bench/learning.py --dtype auto --steps-b 15         # ... auto running 15 steps: also compared at equal time
    python bench/learning.py --cold-start bench/specs/cold-start-sft.yaml --spec bench/specs/cold-start-grpo.yaml
                                                               # SFT, then GRPO from it: base, SFT, GRPO, paired

`--code DIR` puts DIR first on PYTHONPATH, so an older commit (a `git worktree`) runs the same specs
with this virtual environment; only fields that commit knows may be in the spec.
Every seed is a separate process. A benchmark, never a test: ten steps on a 2-core CPU take minutes.
Ends with one line per spec:
RESULT spec=... seeds=... acc0_mean=... acc10_mean=... acc10_se=... gain_mean=... min_gain=... reward_mean=...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPECS = (ROOT / "examples" / "demo-smollm2.yaml", ROOT / "bench" / "specs" / "matched-trl.yaml")
RUN = "import sys; from service.cli import main; sys.argv[0] = 'grpo-jobs'; main()"


@dataclass(frozen=True)
class SeedRun:
    """One seed's learning curve."""

    seed: int
    accuracy: dict[int, float]  # step -> eval/accuracy
    reward_mean: float  # mean of reward/mean over the training steps
    wall_s: float
    series: dict[str, list[float]]  # every training metric over the steps that recorded it, in order
    evals: dict[int, dict[str, float]]  # step -> its evaluation's eval/* metrics

    @property
    def means(self) -> dict[str, float]:
        """Each training metric's mean over the steps that recorded it."""
        return {k: statistics.fmean(v) for k, v in self.series.items()}

    def gain(self, last: int) -> float:
        return self.accuracy[last] - self.accuracy[0]


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for a single value)."""
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0)


def eval_metric(spec: dict) -> str:
    """What a seed is measured by: greedy accuracy, or for an agent (an environment) the episodes' reward."""
    return "eval/reward_mean" if "environment" in spec else "eval/accuracy"


def section(spec: dict) -> str:
    """The spec's loop section: `sft` for an SFT job, `grpo` for the others."""
    return "sft" if spec.get("kind") == "sft" else "grpo"


def run_seed(spec: dict, seed: int, *, code: Path, threads: int, work: Path, tag: str = "",
             init_from: Path | None = None) -> SeedRun:
    """`spec` run with <loop>.seed = seed by `grpo-jobs run` in its own process, in work/<tag>seed-<seed>
    (from `init_from`'s last checkpoint, an earlier run's folder, where given). Only the last step is
    checkpointed."""
    d = json.loads(json.dumps(spec))
    loop = d.setdefault(section(d), {})
    loop["seed"] = seed
    loop["checkpoint_every"] = 0
    if section(d) == "grpo":
        loop["samples_per_step"] = 0
    spec_file, out = work / f"{tag}seed-{seed}.yaml", work / f"{tag}seed-{seed}"
    spec_file.write_text(yaml.safe_dump(d))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    start = [] if init_from is None else ["--init-from", str(init_from)]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RUN, "run", str(spec_file), "--out", str(out), *start], env=env,
                          cwd=code, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = eval_metric(spec)
    acc = {m["step"]: m["metrics"][measured] for m in lines if measured in m["metrics"]}
    rewards = [m["metrics"]["reward/mean"] for m in lines if m["step"] > 0 and "reward/mean" in m["metrics"]]
    per_key: dict[str, list[float]] = {}
    for m in lines:
        if m["step"] > 0:
            for k, v in m["metrics"].items():
                per_key.setdefault(k, []).append(v)
    evals = {m["step"]: {k: v for k, v in m["metrics"].items() if k.startswith("eval/")} for m in lines
             if measured in m["metrics"]}
    return SeedRun(seed, acc, statistics.fmean(rewards) if rewards else float("nan"), wall, per_key, evals)


def bench_spec(path: Path, args: argparse.Namespace) -> None:
    spec = yaml.safe_load(path.read_text())
    if args.steps:
        spec["grpo"]["steps"] = args.steps
    steps = spec["grpo"]["steps"]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(lambda s: run_seed(spec, s, code=args.code, threads=args.threads, work=Path(tmp)), seeds))
    shown = sorted({step for r in runs for step in r.accuracy})
    print(f"\n{path.name} ({steps} steps, code: {args.code}; acc@ is {eval_metric(spec)})")
    print("seed  " + "  ".join(f"acc@{s:<3}" for s in shown) + "  gain    reward  wall_s")
    for r in runs:
        print(f"{r.seed:<5} " + "  ".join(f"{r.accuracy.get(s, float('nan')):6.3f}" for s in shown)
              + f"  {r.gain(steps):+6.3f}  {r.reward_mean:6.3f}  {r.wall_s:6.0f}")
    per_step = {s: mean_se([r.accuracy[s] for r in runs if s in r.accuracy]) for s in shown}
    print("mean  " + "  ".join(f"{per_step[s][0]:6.3f}" for s in shown))
    print("se    " + "  ".join(f"{per_step[s][1]:6.3f}" for s in shown))
    gains = [r.gain(steps) for r in runs]
    gain_m, gain_se = mean_se(gains)
    reward_m, _ = mean_se([r.reward_mean for r in runs])
    print(f"RESULT spec={path.stem} seeds={len(runs)} acc0_mean={per_step[0][0]:.3f} "
          f"acc{steps}_mean={per_step[steps][0]:.3f} acc{steps}_se={per_step[steps][1]:.3f} "
          f"gain_mean={gain_m:.3f} gain_se={gain_se:.3f} min_gain={min(gains):.3f} reward_mean={reward_m:.3f}",
          flush=True)


def compare_dtype(path: Path, args: argparse.Namespace) -> None:
    """The spec as it is (float32 where it names no dtype) and with model.dtype = args.dtype, paired by seed (each pair run side by side, so both
    see the same machine): each side's accuracy at the last step, the paired difference with its 95% interval,
    and the wall-time ratio."""
    from service.core import evidence

    spec = yaml.safe_load(path.read_text())
    if args.steps:
        spec["grpo"]["steps"] = args.steps
    steps = spec["grpo"]["steps"]
    steps_b = args.steps_b or steps  # the other side's last step: more steps where they cost it less time
    other = {**spec, "model": {**spec["model"], "dtype": args.dtype, **({"fp32_head": True} if args.fp32_head else {})},
             "grpo": {**spec["grpo"], "steps": steps_b}}
    mine = spec["model"].get("dtype", "float32")  # the baseline: float32 where the spec names no dtype
    spec = {**spec, "model": {**spec["model"], "dtype": mine}}  # named, since `auto` is the default
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    jobs = [(side, s) for s in seeds for side in (mine, args.dtype)]
    # --eval-float32: the other side's last adapter, loaded onto the spec's own weights and evaluated there
    # (the step-0 evaluation of a one-step run from it), which tells training's share of a gap from evaluation's
    rerun = {**spec, "grpo": {**spec["grpo"], "steps": 1}}
    evaluated = f"{args.dtype}-eval-{mine}"

    def one(job: tuple[str, int], work: Path) -> list[tuple[tuple[str, int], SeedRun]]:
        side, seed = job
        run = run_seed(spec if side == mine else other, seed, code=args.code, threads=args.threads, work=work,
                       tag=f"{side}-")
        out = [(job, run)]
        if args.eval_float32 and side != mine:
            out.append(((evaluated, seed), run_seed(rerun, seed, code=args.code, threads=args.threads, work=work,
                                                    tag=f"{evaluated}-", init_from=work / f"{side}-seed-{seed}")))
        return out

    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        done = list(pool.map(lambda j: one(j, Path(tmp)), jobs))
    runs = {key: r for pairs in done for key, r in pairs}
    head = " with model.fp32_head" if args.fp32_head else ""
    print(f"\n{path.name}: model.dtype {mine} against {args.dtype}{head}, {steps} steps, {len(seeds)} paired seeds")
    late = f"{args.dtype} @{steps_b}" if steps_b != steps else ""
    print(f"seed  {mine + ' acc':<16}{args.dtype + ' acc':<16}{late:<16}{mine + ' s':<12}{args.dtype + ' s':<12}")
    for s in seeds:
        a, b = runs[mine, s], runs[args.dtype, s]
        b_late = f"{b.accuracy[steps_b]:.3f}" if late else ""
        print(f"{s:<5} {a.accuracy[steps]:<16.3f}{b.accuracy[steps]:<16.3f}{b_late:<16}{a.wall_s:<12.0f}{b.wall_s:<12.0f}")
    diff = evidence.mean_interval([runs[args.dtype, s].accuracy[steps] - runs[mine, s].accuracy[steps] for s in seeds])
    wall = statistics.fmean(runs[args.dtype, s].wall_s / runs[mine, s].wall_s for s in seeds)
    acc = {side: mean_se([runs[side, s].accuracy[steps] for s in seeds]) for side in (mine, args.dtype)}
    print(f"acc{steps}: {mine} {acc[mine][0]:.3f} ± {acc[mine][1]:.3f}, {args.dtype} {acc[args.dtype][0]:.3f} ± "
          f"{acc[args.dtype][1]:.3f}; paired difference {diff.estimate:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]; "
          f"wall time {wall:.2f}x")
    more = ""
    if steps_b != steps:  # the other side at its own last step against this side at the spec's: equal time, if
        # steps_b / steps is about 1 / (the step-time ratio)
        late = [runs[args.dtype, s].accuracy[steps_b] - runs[mine, s].accuracy[steps] for s in seeds]
        diff_t = evidence.mean_interval(late)
        m, se = mean_se([runs[args.dtype, s].accuracy[steps_b] for s in seeds])
        print(f"{args.dtype} at step {steps_b} ({wall:.2f}x the wall time of {mine}'s {steps} steps): {m:.3f} ± {se:.3f}; "
              f"paired difference against {mine} at step {steps} {diff_t.estimate:+.3f} [{diff_t.low:+.3f}, {diff_t.high:+.3f}]")
        more += (f" steps_b={steps_b} acc_b_last={m:.3f} diff_last={diff_t.estimate:+.3f} lo_last={diff_t.low:+.3f} "
                 f"hi_last={diff_t.high:+.3f}")
    if args.eval_float32:
        acc_e = [runs[evaluated, s].accuracy[0] for s in seeds]  # the step-0 evaluation: the trained adapter
        print("seed  " + "  ".join(f"{s}: {a:.3f}" for s, a in zip(seeds, acc_e))
              + f"  ({args.dtype}'s adapters evaluated in {mine})")
        diff_e = evidence.mean_interval([a - runs[mine, s].accuracy[steps] for s, a in zip(seeds, acc_e)])
        m, se = mean_se(acc_e)
        print(f"{args.dtype} trained, evaluated in {mine}: {m:.3f} ± {se:.3f}; paired difference against {mine} "
              f"{diff_e.estimate:+.3f} [{diff_e.low:+.3f}, {diff_e.high:+.3f}]")
        more += f" acc_b_eval_a={m:.3f} diff_eval_a={diff_e.estimate:+.3f} lo_eval_a={diff_e.low:+.3f} hi_eval_a={diff_e.high:+.3f}"
    print(f"RESULT spec={path.stem} compare={mine}:{args.dtype}{'+fp32_head' if args.fp32_head else ''} seeds={len(seeds)} acc_a={acc[mine][0]:.3f} "
          f"acc_b={acc[args.dtype][0]:.3f} diff={diff.estimate:+.3f} lo={diff.low:+.3f} hi={diff.high:+.3f} "
          f"wall_ratio={wall:.3f}{more}", flush=True)


# a cold start's figures at each stage: the episodes' reward, and their tool calls and failed calls per episode
STAGE_KEYS = {"reward": "eval/reward_mean", "calls": "eval/env/tool_calls_mean",
              "failed_calls": "eval/env/tool_errors_mean"}


@dataclass(frozen=True)
class ColdStart:
    """One seed's SFT run and the GRPO run from its last checkpoint."""

    sft: SeedRun
    grpo: SeedRun

    def stages(self) -> dict[str, dict[str, float]]:
        """The evaluation of the base model (SFT's step 0), after SFT (its last) and after GRPO (GRPO's last)."""
        return {"base": self.sft.evals[min(self.sft.evals)], "sft": self.sft.evals[max(self.sft.evals)],
                "grpo": self.grpo.evals[max(self.grpo.evals)]}


def cold_start(path: Path, args: argparse.Namespace) -> None:
    """Per seed, the SFT spec args.cold_start, then the GRPO spec `path` from its last checkpoint with the same
    seed; each stage's evaluation (STAGE_KEYS) and GRPO's paired gain in reward over SFT alone, with its 95%
    interval. GRPO's own step-0 evaluation is SFT's last model again: printed as a check."""
    from service.core import evidence

    sft, grpo = yaml.safe_load(args.cold_start.read_text()), yaml.safe_load(path.read_text())
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)

        def both(seed: int) -> ColdStart:
            first = run_seed(sft, seed, code=args.code, threads=args.threads, work=work, tag="sft-")
            pair = ColdStart(first, run_seed(grpo, seed, code=args.code, threads=args.threads, work=work,
                                             tag="grpo-", init_from=work / f"sft-seed-{seed}"))
            st = pair.stages()
            print(f"seed {seed}: reward {st['base']['eval/reward_mean']:.3f} -> {st['sft']['eval/reward_mean']:.3f} "
                  f"-> {st['grpo']['eval/reward_mean']:.3f} (GRPO's step 0: "
                  f"{pair.grpo.evals[min(pair.grpo.evals)]['eval/reward_mean']:.3f}); "
                  f"{first.wall_s:.0f} s + {pair.grpo.wall_s:.0f} s", flush=True)
            return pair

        with ThreadPoolExecutor(args.parallel) as pool:
            pairs = list(pool.map(both, seeds))
    print(f"\n{args.cold_start.name} then {path.name}, {len(seeds)} seeds (each stage: "
          + ", ".join(f"{name} = {key}" for name, key in STAGE_KEYS.items()) + ")")
    print("seed  " + "  ".join(f"{stage}:{name:<13}" for stage in ("base", "sft", "grpo") for name in STAGE_KEYS))
    for seed, pair in zip(seeds, pairs):
        st = pair.stages()
        print(f"{seed:<5} " + "  ".join(f"{st[stage].get(key, float('nan')):<{len(stage) + 14}.3f}"
                                       for stage in ("base", "sft", "grpo") for key in STAGE_KEYS.values()))
    means = {stage: {name: mean_se([p.stages()[stage].get(key, float("nan")) for p in pairs])
                     for name, key in STAGE_KEYS.items()} for stage in ("base", "sft", "grpo")}
    for stage, figures in means.items():
        print(f"{stage:<5} " + ", ".join(f"{name} {m:.3f} ± {se:.3f}" for name, (m, se) in figures.items()))
    gain = evidence.mean_interval([p.stages()["grpo"]["eval/reward_mean"] - p.stages()["sft"]["eval/reward_mean"]
                                   for p in pairs])
    print(f"GRPO over SFT alone, paired: {gain.estimate:+.3f} [{gain.low:+.3f}, {gain.high:+.3f}]")
    print(f"RESULT cold_start={args.cold_start.stem} spec={path.stem} seeds={len(seeds)} "
          + " ".join(f"{stage}_{name}={m:.3f}" for stage, figures in means.items() for name, (m, _) in figures.items())
          + f" gain={gain.estimate:+.3f} lo={gain.low:+.3f} hi={gain.high:+.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, action="append", help="a spec file (repeatable); default: the demo and matched specs")
    ap.add_argument("--seeds", type=int, default=6, help="how many seeds")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds run from this one up")
    ap.add_argument("--steps", type=int, default=0, help="override grpo.steps (0: the spec's)")
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose code runs the specs")
    ap.add_argument("--parallel", type=int, default=1, help="seeds run at once")
    ap.add_argument("--threads", type=int, default=0, help="threads per seed (default: cores / parallel)")
    ap.add_argument("--dtype", help="also run every seed with this model.dtype (auto, bfloat16) and compare, paired")
    ap.add_argument("--eval-float32", action="store_true", help="with --dtype: also evaluate that side's trained "
                    "adapters on the spec's own (float32) weights, so training's share of a gap is told from evaluation's")
    ap.add_argument("--fp32-head", action="store_true", help="with --dtype: that side also sets model.fp32_head "
                    "(the LM head's matmul in float32)")
    ap.add_argument("--steps-b", type=int, default=0, help="with --dtype: that side runs this many steps (it must "
                    "evaluate at the spec's last step too), and is also compared at its own last step: equal time "
                    "where the step ratio is the inverse of the steps'")
    ap.add_argument("--cold-start", type=Path, help="an sft spec run first for every seed; each --spec then starts "
                    "from its last checkpoint, and GRPO's gain over SFT alone is measured, paired")
    ap.add_argument("--keep", type=Path, help="with --cold-start: keep every seed's runs in this folder "
                    "(sft-seed-N/, grpo-seed-N/), for bench/trl_agents.py")
    args = ap.parse_args()
    args.code = args.code.resolve()
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.parallel)
    for path in args.spec or DEFAULT_SPECS:
        (cold_start if args.cold_start else compare_dtype if args.dtype else bench_spec)(path, args)


if __name__ == "__main__":
    main()
