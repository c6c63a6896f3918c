"""How the share of parameters a run leaves unchanged evolves with training length, GRPO against SFT,
at matched learning rate, steps and precision: the curves behind "RL updates are sparse".

Four full fine-tuning runs from one base on one task: {GRPO, SFT} x {float32 weights (fp32 master
weights), bfloat16 weights (AdamW updating bf16 weights, no master copy)}, each measured after every
optimizer step (`sparsity.measure_interval: 1`): the unchanged share of the step's own update
(`window`) and of everything since the start (`cumulative`), compared exactly (tolerance 0) in
float32 and with both snapshots rounded to bfloat16 (as released checkpoints are compared), and
KL(pi_0 || pi) on held-out prompts of the task (`kl_task`, nats per completion).

Base and task: bench/selection_noisy.py's (a 4-layer Llama trained here on sums of one-digit numbers to
about 45% accuracy, the clean training rows). A small model makes hundreds of measured steps
affordable on two cores; what decides the unchanged share, an AdamW update of about lr per weight
against a weight's bf16 step (2^-8 of its magnitude), is the same arithmetic at any size.

    python bench/sparsity_curves.py                        # 200 steps per run
    python bench/sparsity_curves.py --steps 20 --parallel 2

A benchmark, never a test. Ends with one line per run:
RESULT run=... steps=... cum_bf16=... cum_fp32=... win_bf16_last=... kl_task=...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml
from learning import ROOT, RUN  # bench/ is on the path when a bench runs
from selection_noisy import MODEL, make_task, pretrain_base, write_rows

RUNS = (("grpo", "float32"), ("sft", "float32"), ("grpo", "bfloat16"), ("sft", "bfloat16"))


def spec(method: str, dtype: str, args: argparse.Namespace) -> dict:
    common = {"model": {"name": MODEL, "dtype": dtype},
              "dataset": {"name": "jsonl", "path": "train-clean.jsonl", "val_path": "val.jsonl"},
              "sparsity": {"measure_interval": 1, "kl_prompts": 16}}
    if method == "grpo":  # no KL term: the distance from pi_0 is the method's own doing
        return {**common, "kind": "grpo", "name": f"curves-grpo-{dtype}", "rewards": [{"name": "numeric_match"}],
                "grpo": {"steps": args.steps, "prompts_per_step": 8, "num_generations": 8, "max_new_tokens": 4,
                         "temperature": 1.0, "learning_rate": args.lr, "micro_batch_size": 64, "eval_prompts": 100,
                         "eval_every": args.steps, "samples_per_step": 0, "checkpoint_every": 0}}
    return {**common, "kind": "sft", "name": f"curves-sft-{dtype}",  # as many sequences a step as GRPO's 8 x 8
            "sft": {"steps": args.steps, "batch_size": 64, "learning_rate": args.lr, "max_new_tokens": 4,
                    "eval_prompts": 100, "eval_every": args.steps, "checkpoint_every": 0}}


@dataclass(frozen=True)
class Curve:
    """One run's measurements, step by step."""

    name: str
    window_bf16: dict[int, float]  # step -> unchanged share of that step's update, both rounded to bf16
    cum_bf16: dict[int, float]  # since the start, bf16
    cum_fp32: dict[int, float]  # since the start, float32 exactly
    kl_task: dict[int, float]
    accuracy: tuple[float, float]  # held-out eval/accuracy at the start and the end


def run(method: str, dtype: str, args: argparse.Namespace) -> Curve:
    name = f"{method}-{dtype}"
    path, out = args.work / f"curves-{name}.yaml", args.work / f"curves-{name}"
    path.write_text(yaml.safe_dump(spec(method, dtype, args)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "GRPO_MODEL_ROOTS": str(args.work / "models"),
           "GRPO_DATASETS_ROOT": str(args.work / "data"), "GRPO_DATA_DIR": str(out / "service")}
    proc = subprocess.run([sys.executable, "-c", RUN, "run", str(path), "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    win, cum_bf16, cum_fp32, kl = {}, {}, {}, {}
    for line in (out / "sparsity.jsonl").read_text().splitlines():
        r = json.loads(line)
        p, step = r["report"]["precision"], r["step"]
        if r["scope"] == "window":
            win[step] = p["bf16"]["0.0"]
        else:
            cum_bf16[step], cum_fp32[step] = p["bf16"]["0.0"], p["fp32"]["0.0"]
            if r["report"].get("kl_task") is not None:
                kl[step] = r["report"]["kl_task"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    acc = [m["metrics"]["eval/accuracy"] for m in metrics if "eval/accuracy" in m["metrics"]]
    return Curve(name, win, cum_bf16, cum_fp32, kl, (acc[0], acc[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-5, help="both methods' AdamW learning rate (bench/rl_vs_sft.py's)")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/selection-noisy"), help="shared with bench/selection_noisy.py")
    args = ap.parse_args()
    args.work = args.work.resolve()
    task = make_task(seed=0, n_train=2000, n_val=200, n_test=500, noise=0.0)  # the same questions, every answer right
    (args.work / "data").mkdir(parents=True, exist_ok=True)
    write_rows(args.work / "data" / "train-clean.jsonl", task.train)
    write_rows(args.work / "data" / "val.jsonl", task.val)
    if not (args.work / "models" / MODEL / "config.json").exists():
        pretrain_base(args.work / "models" / MODEL, task, target=0.45, seed=0)
    with ThreadPoolExecutor(args.parallel) as pool:
        curves = list(pool.map(lambda md: run(*md, args), RUNS))
    shown = [s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if s <= args.steps]
    print(f"\nunchanged share (tolerance 0) after N steps, lr {args.lr}, full fine-tuning; KL(pi_0 || pi) on the task")
    print(f"{'run':<16}{'what':<26}" + "".join(f"{s:>9}" for s in shown))
    for c in curves:
        for label, series in (("this step, bf16", c.window_bf16), ("since start, bf16", c.cum_bf16),
                              ("since start, fp32", c.cum_fp32), ("KL on the task (nats)", c.kl_task)):
            print(f"{c.name:<16}{label:<26}" + "".join(f"{series.get(s, float('nan')):>9.4f}" for s in shown))
        print(f"{c.name:<16}{'held-out accuracy':<26}{c.accuracy[0]:.3f} -> {c.accuracy[1]:.3f}")
    (args.work / "sparsity-curves.json").write_text(json.dumps([c.__dict__ for c in curves]))
    for c in curves:
        last = max(c.cum_bf16)
        print(f"RESULT run={c.name} steps={last} cum_bf16={c.cum_bf16[last]:.4f} cum_fp32={c.cum_fp32[last]:.4f} "
              f"win_bf16_last={c.window_bf16[last]:.4f} kl_task={c.kl_task.get(last, float('nan')):.4f} "
              f"acc={c.accuracy[0]:.3f}->{c.accuracy[1]:.3f}", flush=True)


if __name__ == "__main__":
    main()
