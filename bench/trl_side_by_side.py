"""The matched GRPO step timed against TRL's GRPOTrainer on this machine: the same model, prompts, LoRA,
group size, completion length and micro-batch (bench/specs/matched-trl.yaml), each run alone after the
other, seed by seed, in each precision setting of either side.

    make trl                                   # TRL 1.16 in its own environment, .venv-trl
    python bench/trl_side_by_side.py           # 2 seeds x 10 steps: ours in float32 and auto, TRL's four settings
    python bench/trl_side_by_side.py --seeds 3 --steps 8 --ours auto --trl defaults,bf16

TRL's settings (`--trl`): `matched` (float32 weights, no autocast, no gradient checkpointing: the spec's
settings), `defaults` (GRPOConfig's own: float32 weights, bf16 autocast, gradient checkpointing on), `bf16`
(autocast without checkpointing) and `bf16-weights` (the base weights loaded in bfloat16, autocast, no
checkpointing; peft keeps the LoRA adapter float32, as our `auto` does). Ours (`--ours`): the spec's
model.dtype values, `float32` and `auto`.

Each side's step is its median over steps 2..N (the first step warms caches and allocators on both; the
median also keeps our last step's end-of-job evaluation out): ours is `time/step_s` from `grpo-jobs run`,
TRL's the wall time from a step's start to its update (it samples inside the step; bench/trl_grpo.py).
Both sides train on our arith prompts rendered by our chat template and score with our `numeric_match`;
TRL's settings follow the spec (no KL, clip 0.2, constant learning rate).
Prompt order and sampling streams differ by design: it compares the cost of a step, not its draw; the
steps' mean reward is printed beside it, as a check that a setting still learns.
Our side's rows also give each phase's median share of the measured peak (`mfu/*`; TRL measures none).
Ends with a RESULT line per pair of settings: RESULT ours=... trl=... seeds=... ours_step_s=... trl_step_s=...
ratio=... ours_peak_rss_gb=... trl_peak_rss_gb=... ours_reward=... trl_reward=...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from learning import ROOT, run_seed  # bench/ is on the path when a bench runs

from service.core.settings import get_settings
from service.core.specs import GRPOJob
from worker.datasets import load_task, render_example
from worker.model.loading import load_tokenizer, smollm2_dir

SPEC = ROOT / "bench" / "specs" / "matched-trl.yaml"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
TRL_SETTINGS = {  # name -> how bench/trl_grpo.py loads and trains (the task file's `trl`)
    "matched": {"dtype": "float32", "bf16": False, "gradient_checkpointing": False},
    "defaults": {"dtype": "float32", "bf16": True, "gradient_checkpointing": True},  # GRPOConfig's own, TRL 1.16
    "bf16": {"dtype": "float32", "bf16": True, "gradient_checkpointing": False},
    "bf16-weights": {"dtype": "bfloat16", "bf16": True, "gradient_checkpointing": False},
}


def warm(xs: list[float]) -> list[float]:
    """A series without its first step, which warms caches and allocators on both sides."""
    return xs[1:] or xs


@dataclass(frozen=True)
class SideRun:
    """One side's run of one seed."""

    step_s: list[float]  # every step's wall time, in order
    reward_mean: float
    peak_rss_gb: float
    wall_s: float
    mfu: dict[str, float]  # ours: each phase's median share of the measured peak (mfu/*); TRL reports none

    @property
    def median_step_s(self) -> float:
        return statistics.median(warm(self.step_s))


def trl_task(spec: GRPOJob, seed: int, setting: str) -> dict:
    """What bench/trl_grpo.py needs: the model folder, our rendered training prompts, the matched settings."""
    settings = get_settings()
    tokenizer = load_tokenizer(spec.model, models_root=settings.models_dir)
    data = load_task(spec.dataset, settings=settings, reward_names=[r.name for r in spec.rewards])
    g, lora = spec.grpo, spec.model.lora
    rows = g.prompts_per_step * g.num_generations
    return {
        "seed": seed, "trl": TRL_SETTINGS[setting], "model_dir": str(smollm2_dir(settings.models_dir)),
        "prompts": [render_example(tokenizer, ex, data.instruction) for ex in data.train],
        "answers": [list(ex.answers) for ex in data.train],
        "matched": {"steps": g.steps, "prompts_per_step": g.prompts_per_step, "num_generations": g.num_generations,
                    "max_new_tokens": g.max_new_tokens, "temperature": g.temperature, "learning_rate": g.learning_rate,
                    "kl_coef": g.kl_coef, "clip_eps": g.clip_eps_low, "max_grad_norm": g.max_grad_norm,
                    "micro_batch_size": g.micro_batch_size or rows, "lora_r": lora.r, "lora_alpha": lora.alpha},
    }


def run_trl(task: dict, work: Path, threads: int) -> SideRun:
    name = f"trl-{task['seed']}-{task['trl']['dtype']}-{task['trl']['bf16']}-{task['trl']['gradient_checkpointing']}"
    task_file, out = work / f"{name}.json", work / f"{name}-out.json"
    task_file.write_text(json.dumps(task))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    proc = subprocess.run([str(TRL_PYTHON), str(ROOT / "bench" / "trl_grpo.py"), "--task", str(task_file),
                           "--out", str(out)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"TRL seed {task['seed']} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    r = json.loads(out.read_text())
    print("TRL side: " + " ".join(f"{k} {v}" for k, v in r["versions"].items()), flush=True)
    return SideRun(r["step_s"], r["reward_mean"], r["peak_rss_gb"], wall, {})


def run_ours(spec_dict: dict, seed: int, work: Path, threads: int) -> SideRun:
    # a folder per dtype: `grpo-jobs run` into a finished run's folder would resume it, not train again
    r = run_seed(spec_dict, seed, code=ROOT, threads=threads, work=work, tag=f"ours-{spec_dict['model']['dtype']}-")
    mfu = {k: statistics.median(warm(v)) for k, v in r.series.items() if k.startswith("mfu/")}
    return SideRun(r.series["time/step_s"], r.reward_mean, max(r.series["memory/peak_rss_gb"]), r.wall_s, mfu)


def show(seed: int, side: str, r: SideRun) -> None:
    steps = " ".join(f"{s:.1f}" for s in r.step_s)
    mfu = " ".join(f"{k}={v:.3f}" for k, v in sorted(r.mfu.items()))
    print(f"{seed:<5} {side:<18} {r.median_step_s:13.2f} {steps:<60} {r.reward_mean:6.3f} {r.peak_rss_gb:11.2f} {mfu}",
          flush=True)


def choices(arg: str, known: tuple[str, ...] | dict, what: str) -> list[str]:
    names = [n for n in arg.split(",") if n]
    if not names or any(n not in known for n in names):
        raise SystemExit(f"{what}: choose among {', '.join(known)} (got {arg!r})")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ours", default="float32,auto", help="our model.dtype settings, comma-separated")
    ap.add_argument("--trl", default=",".join(TRL_SETTINGS), help="TRL's settings, comma-separated: "
                    + ", ".join(TRL_SETTINGS))
    args = ap.parse_args()
    ours_as, trl_as = choices(args.ours, ("float32", "auto"), "--ours"), choices(args.trl, TRL_SETTINGS, "--trl")
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run `make trl` first")
    spec_dict = yaml.safe_load(SPEC.read_text())
    spec_dict["grpo"].update(steps=args.steps, eval_every=0)
    print(f"{'seed':<5} {'side':<18} {'median_step_s':>13} {'steps_s':<60} {'reward':>6} {'peak_rss_gb':>11} mfu")
    runs: dict[str, list[SideRun]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            spec_dict["grpo"]["seed"] = seed
            for name in trl_as:
                task = trl_task(GRPOJob.model_validate(spec_dict), seed, name)
                runs.setdefault(f"trl:{name}", []).append(run_trl(task, Path(tmp), args.threads))
                show(seed, f"trl:{name}", runs[f"trl:{name}"][-1])
            for dtype in ours_as:
                mine = {**spec_dict, "model": {**spec_dict["model"], "dtype": dtype}}
                runs.setdefault(f"ours:{dtype}", []).append(run_ours(mine, seed, Path(tmp), args.threads))
                show(seed, f"ours:{dtype}", runs[f"ours:{dtype}"][-1])

    def step(side: str) -> float:
        return statistics.median(r.median_step_s for r in runs[side])

    for dtype in ours_as:
        ours = runs[f"ours:{dtype}"]
        mfu = " ".join(f"ours_{k.split('/')[1]}={statistics.median(r.mfu[k] for r in ours):.3f}"
                       for k in sorted(ours[0].mfu))
        for name in trl_as:
            trl = runs[f"trl:{name}"]
            print(f"RESULT ours={dtype} trl={name} seeds={args.seeds} steps={args.steps} "
                  f"ours_step_s={step(f'ours:{dtype}'):.2f} trl_step_s={step(f'trl:{name}'):.2f} "
                  f"ratio={step(f'ours:{dtype}') / step(f'trl:{name}'):.3f} "
                  f"ours_peak_rss_gb={max(r.peak_rss_gb for r in ours):.2f} "
                  f"trl_peak_rss_gb={max(r.peak_rss_gb for r in trl):.2f} "
                  f"ours_reward={statistics.fmean(r.reward_mean for r in ours):.3f} "
                  f"trl_reward={statistics.fmean(r.reward_mean for r in trl):.3f} {mfu}")


if __name__ == "__main__":
    main()
