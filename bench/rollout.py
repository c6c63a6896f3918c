"""The rollout engines side by side: the same spec sampled by Hugging Face `generate` (`hf`) and by a
vLLM server of the job's own (`vllm`), each in its own `grpo-jobs run` process, one after the other on
the same machine. Per engine, over the steps after the first (the first warms caches up):

    rollout tok/s   completion tokens / (rollout time - sync time), the sampler's own speed
    rollout_s       sampling + scoring per step;  sync_s: loading the step's weights into the engine
    train_s, step_s the update, and the whole step
    |dlogp| mean/max  engine vs trainer log-probs of the same tokens (vllm only; hf's are the trainer's)
    ratio p05/p95   pi_trainer / q_engine quantiles;  changed: tokens the correction truncated or masked
    acc             greedy held-out accuracy at the last step

    python bench/rollout.py                            # bench/specs/rollout-arith.yaml, 1 seed
    python bench/rollout.py --seeds 3 --steps 10       # learning over seeds too (acc mean ± se)
    python bench/rollout.py --engines vllm --full      # full fine-tuning (weights reloaded in place)

An engine is `hf`, `vllm`, or `vllm:1`: vllm with rollout.max_staleness 1 (step k+1 sampled while step
k trains; its |dlogp| then includes the update, and `stale` is the mean lag in weight versions).

The vLLM side needs GRPO_VLLM_PYTHON (default: .venv-vllm/bin/python, from `make vllm`). On a CPU the
server runs eager (no compile) and shares the cores with the trainer: no speed-up is expected there;
the gain is on a GPU. Ends with one line per engine:
RESULT engine=... rollout_tok_s=... rollout_s=... sync_s=... step_s=... logp_abs_max=... acc_mean=...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import yaml
from learning import ROOT, mean_se, run_seed  # bench/ is on the path when a bench runs

SPEC = ROOT / "bench" / "specs" / "rollout-arith.yaml"
KEYS = ("throughput/rollout_tokens_per_s", "time/rollout_s", "time/sync_s", "time/train_s", "time/step_s",
        "mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/ratio_p05", "mismatch/ratio_p95",
        "correction/changed_fraction", "rollout/staleness")


def after_first(key: str, out: Path) -> float:
    """The mean of `key` over the steps after the first (nan when the run never recorded it)."""
    values = [json.loads(line)["metrics"].get(key) for line in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["step"] > 1]
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, default=SPEC)
    ap.add_argument("--engines", default="hf,vllm,vllm:1", help="comma-separated: hf, vllm, vllm:1")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--steps", type=int, default=0, help="override grpo.steps (0: the spec's)")
    ap.add_argument("--full", action="store_true", help="full fine-tuning instead of the spec's LoRA")
    args = ap.parse_args()
    os.environ.setdefault("GRPO_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    spec = yaml.safe_load(args.spec.read_text())
    if args.steps:
        spec["grpo"]["steps"] = args.steps
        spec["grpo"]["eval_every"] = args.steps
    if args.full:
        spec["model"].pop("lora", None)
        spec["grpo"]["learning_rate"] = 1e-5
    threads = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for engine in args.engines.split(","):
            name, _, staleness = engine.partition(":")
            rollout = {"engine": name, **({"max_staleness": int(staleness)} if staleness else {})}
            tag = engine.replace(":", "-stale")
            runs = [run_seed({**spec, "rollout": rollout}, seed, code=ROOT, threads=threads, work=work, tag=f"{tag}-")
                    for seed in range(args.first_seed, args.first_seed + args.seeds)]
            outs = [work / f"{tag}-seed-{r.seed}" for r in runs]
            stats = {k: statistics.fmean(after_first(k, o) for o in outs) for k in KEYS}
            last = max(s for s in runs[0].accuracy)
            acc = mean_se([r.accuracy[last] for r in runs])
            rows.append((engine, stats, acc, statistics.fmean(r.wall_s for r in runs), runs))
    steps = spec["grpo"]["steps"]
    print(f"\n{args.spec.name} ({'full' if args.full else 'LoRA'}, {steps} steps, {args.seeds} seed(s), "
          f"{os.cpu_count()} cores)")
    print("engine  rollout_tok/s  rollout_s  sync_s  train_s  step_s  |dlogp|mean  |dlogp|max  ratio_p05  "
          "ratio_p95  changed  stale  acc        wall_s")
    for engine, st, (acc_m, acc_se), wall, _ in rows:
        print(f"{engine:<7} {st['throughput/rollout_tokens_per_s']:13.1f}  {st['time/rollout_s']:9.2f}  "
              f"{st['time/sync_s']:6.3f}  {st['time/train_s']:7.2f}  {st['time/step_s']:6.2f}  "
              f"{st['mismatch/logp_abs_mean']:11.2e}  {st['mismatch/logp_abs_max']:10.2e}  "
              f"{st['mismatch/ratio_p05']:9.5f}  "
              f"{st['mismatch/ratio_p95']:9.5f}  {st['correction/changed_fraction']:7.4f}  "
              f"{st['rollout/staleness']:5.2f}  {acc_m:.3f}±{acc_se:.3f}  "
              f"{wall:6.0f}")
    for engine, _, _, _, runs in rows:  # what the mean hides: each seed's accuracy
        print(f"{engine}: " + ", ".join(f"seed {r.seed} acc@{max(r.accuracy)}={r.accuracy[max(r.accuracy)]:.3f}"
                                        for r in runs))
    for engine, st, (acc_m, _), _, _ in rows:
        print(f"RESULT engine={engine} rollout_tok_s={st['throughput/rollout_tokens_per_s']:.1f} "
              f"rollout_s={st['time/rollout_s']:.2f} sync_s={st['time/sync_s']:.3f} step_s={st['time/step_s']:.2f} "
              f"logp_abs_max={st['mismatch/logp_abs_max']:.2e} acc_mean={acc_m:.3f}", flush=True)


if __name__ == "__main__":
    main()
