"""RL against SFT from the same base on the same task, full fine-tuning: how much of the model each
changed (unchanged shares in fp32 and bf16), how far each moved on the task (KL(pi_0 || pi) on
held-out prompts), the rank of the updates, and what each forgot of a task it did not train on.

1. GRPO (bench/specs/rl-vs-sft-grpo.yaml): the bundled SmolLM2-135M, full fine-tuning, one-digit sums;
   one cumulative sparsity report at the last step.
2. SFT (bench/specs/rl-vs-sft-sft.yaml): the same base and task, evaluated, checkpointed and measured
   every `eval_every` steps; the run is read at the first evaluation whose held-out accuracy reaches
   GRPO's final one (matched accuracy), else at its last (said so).
3. For both: held-out accuracy, the cumulative report's `precision` (fp32 and bf16 at 0, 1e-5, 1e-4)
   and `kl_task`; the update's numerical rank (singular values above 1e-3 of the largest) on every
   weight matrix of three layers; and greedy accuracy on a second task neither trained on (the
   plural of a noun), base model included: the drop is forgetting.

    python bench/rl_vs_sft.py                      # about 30 minutes on 2 cores
    python bench/rl_vs_sft.py --grpo-steps 4 --sft-steps 8

Each run is its own `grpo-jobs run` process. A benchmark, never a test.
Ends with: RESULT method=... acc=... unchanged_bf16=... unchanged_fp32=... kl_task=... rank=... forget_acc=...
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
RUN = "import sys; from service.cli import main; sys.argv[0] = 'grpo-jobs'; main()"
# nouns whose plural adds an s: the second task (the base model answers about half of them right)
WORDS = ["apple", "river", "stone", "cloud", "table", "light", "paper", "horse", "chair", "dream", "ocean", "smile",
         "train", "tiger", "plant", "candle", "forest", "garden", "pencil", "rocket", "window", "flower", "bottle",
         "button", "camera", "doctor", "island", "jacket", "ladder", "monkey", "planet", "rabbit"]
RANK_LAYERS = ("model.layers.0.", "model.layers.15.", "model.layers.29.")


@dataclass(frozen=True)
class Reading:
    """One method at the step it is read at."""

    method: str
    step: int
    accuracy: float
    precision: dict[str, dict[str, float]]  # fp32 / bf16 -> tolerance -> unchanged share
    kl_task: float
    rank: float  # mean numerical rank of the update over the sampled matrices
    rank_of: int  # ... out of min(rows, cols) on average
    forget_acc: float
    note: str = ""


def run_job(spec: dict, out: Path, threads: int) -> list[dict]:
    spec_file = out.with_suffix(".yaml")
    spec_file.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", RUN, "run", str(spec_file), "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{spec['kind']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def cumulative_report(out: Path, step: int) -> dict:
    for line in (out / "sparsity.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["step"] == step and r["scope"] == "cumulative":
            return r["report"]
    raise SystemExit(f"no cumulative sparsity report at step {step} in {out}")


def update_rank(base: dict[str, torch.Tensor], tuned: dict[str, torch.Tensor]) -> tuple[float, int]:
    ranks, sizes = [], []
    for name, w in tuned.items():
        if w.ndim == 2 and name.startswith(RANK_LAYERS):
            s = torch.linalg.svdvals(w.double() - base[name].double())
            ranks.append(int((s > 1e-3 * s[0]).sum()) if s[0] > 0 else 0)
            sizes.append(min(w.shape))
    return sum(ranks) / len(ranks), round(sum(sizes) / len(sizes))


def forgetting_prompts(n: int) -> list[tuple[str, str]]:
    rng = random.Random(7)
    return [(f"What is the plural of '{w}'? Answer with one word.", f"{w}s") for w in rng.sample(WORDS, n)]


@torch.no_grad()
def second_task_accuracy(folder: Path, prompts: list[tuple[str, str]]) -> float:
    """Greedy answers of the model in `folder` (a transformers folder) through its chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.datasets import render_prompt

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = [render_prompt(tok, q, "") for q, _ in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(expected in a.lower() for a, (_, expected) in zip(answers, prompts)) / len(prompts)


def read(method: str, out: Path, step: int, acc: float, base_folder: Path, prompts, note: str = "") -> Reading:
    report = cumulative_report(out, step)
    ckpt = out / "checkpoints" / f"step-{step}"
    rank, of = update_rank(load_file(base_folder / "model.safetensors"), load_file(ckpt / "model.safetensors"))
    return Reading(method, step, acc, report["precision"], report["kl_task"], rank, of,
                   second_task_accuracy(ckpt, prompts), note)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpo-steps", type=int, default=0, help="override the GRPO spec's steps")
    ap.add_argument("--sft-steps", type=int, default=0, help="override the SFT spec's steps")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    grpo = yaml.safe_load((ROOT / "bench" / "specs" / "rl-vs-sft-grpo.yaml").read_text())
    sft = yaml.safe_load((ROOT / "bench" / "specs" / "rl-vs-sft-sft.yaml").read_text())
    if args.grpo_steps:
        grpo["grpo"]["steps"] = grpo["sparsity"]["measure_interval"] = args.grpo_steps
    if args.sft_steps:  # read every 5 steps, or at each step of a shorter run
        every = min(5, args.sft_steps)
        sft["sft"].update(steps=args.sft_steps - args.sft_steps % every, eval_every=every, checkpoint_every=every)
        sft["sparsity"]["measure_interval"] = every
    from service.core.settings import Settings
    from worker.model.loading import smollm2_dir

    base_folder = smollm2_dir(Settings().models_dir)
    prompts = forgetting_prompts(32)
    with tempfile.TemporaryDirectory() as tmp:
        g_out, s_out = Path(tmp) / "grpo", Path(tmp) / "sft"
        g_metrics = run_job(grpo, g_out, args.threads)
        g_acc = {m["step"]: m["metrics"]["eval/accuracy"] for m in g_metrics if "eval/accuracy" in m["metrics"]}
        last = grpo["grpo"]["steps"]
        s_metrics = run_job(sft, s_out, args.threads)
        s_acc = {m["step"]: m["metrics"]["eval/accuracy"] for m in s_metrics if "eval/accuracy" in m["metrics"]}
        measured = sorted(s for s in s_acc if s > 0)
        reached = [s for s in measured if s_acc[s] >= g_acc[last]]
        match = reached[0] if reached else measured[-1]
        note = "matched accuracy" if reached else f"accuracy {g_acc[last]:.3f} not reached: its last evaluation"
        trained = [read("grpo", g_out, last, g_acc[last], base_folder, prompts, f"{last} steps"),
                   read("sft", s_out, match, s_acc[match], base_folder, prompts, f"step {match}: {note}")]
    base_forget = second_task_accuracy(base_folder, prompts)
    readings = [Reading("base", 0, g_acc[0], {}, 0.0, 0.0, trained[0].rank_of, base_forget, "the starting point"),
                *trained]
    print(f"\nSmolLM2-135M, full fine-tuning, one-digit sums; second task: the plural of {len(prompts)} nouns")
    print(f"{'method':<7}{'step':>5} {'acc':>6} {'bf16 =0':>8} {'bf16 1e-5':>10} {'fp32 =0':>8} {'fp32 1e-5':>10} "
          f"{'KL task':>8} {'rank':>11} {'2nd task':>9}  note")
    for r in readings:
        p = r.precision or {"bf16": {}, "fp32": {}}
        cell = lambda d, k: f"{d[k]:.3f}" if k in d else "–"  # noqa: E731
        print(f"{r.method:<7}{r.step:>5} {r.accuracy:6.3f} {cell(p['bf16'], '0.0'):>8} {cell(p['bf16'], '1e-05'):>10} "
              f"{cell(p['fp32'], '0.0'):>8} {cell(p['fp32'], '1e-05'):>10} {r.kl_task:8.3f} "
              f"{r.rank:5.1f}/{r.rank_of:<5} {r.forget_acc:9.3f}  {r.note}")
    for r in readings[1:]:
        print(f"RESULT method={r.method} step={r.step} acc={r.accuracy:.3f} "
              f"unchanged_bf16={r.precision['bf16']['0.0']:.4f} unchanged_bf16_1e-5={r.precision['bf16']['1e-05']:.4f} "
              f"unchanged_fp32={r.precision['fp32']['0.0']:.4f} unchanged_fp32_1e-5={r.precision['fp32']['1e-05']:.4f} "
              f"kl_task={r.kl_task:.4f} rank={r.rank:.1f}/{r.rank_of} forget_acc={r.forget_acc:.3f} "
              f"base_forget_acc={base_forget:.3f}", flush=True)


if __name__ == "__main__":
    main()
