"""Cost of a sparsity measurement relative to a training step, measured side by side in one run.

Runs a GRPO training step, then one measurement with tracking only and one with tracking plus
the sparse-quality analysis, and samples the process's resident memory while the tracker builds
its snapshots and measures.

    python bench/sparsity.py [--model smollm2-135m-instruct] [--lora-r 0]

Ends with: RESULT track_ratio=... quality_ratio=... extra_mem_mb=...
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rss import PeakRss, rss_mb  # bench/ is on the path when a bench runs

from service.core.settings import get_settings
from service.core.specs import GRPOJob
from worker.loops.setup import build
from worker.loops.skeleton import Run
from worker.loops.sources import collect_train_rollouts
from worker.loops.update import train_epochs
from worker.reporting import Reporter
from worker.sparsity_tracker import SparsityTracker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lora-r", type=int, default=0, help="0: full fine-tuning (every weight tracked)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--probe-size", type=int, default=4)
    args = ap.parse_args()
    thresholds = [0.0, 1e-12, 1e-10, 1e-8, 1e-6, 1e-4]
    spec = GRPOJob.model_validate({
        "model": {"name": args.model, "lora": {"r": args.lora_r} if args.lora_r else None},
        "dataset": {"name": "arith"},
        "grpo": {"steps": 2, "prompts_per_step": args.prompts, "num_generations": args.generations,
                 "max_new_tokens": args.max_new_tokens, "micro_batch_size": args.prompts * args.generations,
                 "learning_rate": 1e-5},
        "sparsity": {"measure_interval": 1, "thresholds": thresholds,
                     "quality": {"enabled": True, "probe_size": args.probe_size}},
    })
    rep = Reporter()
    rep.checkpoint_root = Path(tempfile.mkdtemp(prefix="grpo-bench-sparsity-"))
    s = build(spec, get_settings(), rep)
    run = Run(s, rep, evaluate=lambda step: {})
    ro = collect_train_rollouts(s, 0, rep)
    train_epochs(run, ro, None, None, 0)  # warm-up

    base_rss = rss_mb()
    with PeakRss() as peak:
        tracker = SparsityTracker(spec.sparsity, s, rep)
        ro = collect_train_rollouts(s, 1, rep)
        t0 = time.perf_counter()
        train_epochs(run, ro, None, None, 1)
        step_s = time.perf_counter() - t0

        probe, tracker.probe = tracker.probe, None
        t0 = time.perf_counter()
        tracker.measure(1)
        track_s = time.perf_counter() - t0
        tracker.probe = probe
        ro = collect_train_rollouts(s, 2, rep)
        train_epochs(run, ro, None, None, 2)
        t0 = time.perf_counter()
        tracker.measure(2)
        quality_s = time.perf_counter() - t0
    n = sum(p.numel() for _, p in tracker.params)
    print(f"{args.model} ({f'LoRA r={args.lora_r}' if args.lora_r else 'full fine-tuning'}), {n:,} tracked "
          f"parameters: train step {step_s:.2f} s, tracking {track_s:.2f} s, tracking + quality "
          f"({len(thresholds)} thresholds x 2 masks, probe {args.probe_size}) {quality_s:.2f} s")
    print(f"RESULT track_ratio={track_s / step_s:.3f} quality_ratio={quality_s / step_s:.3f} "
          f"extra_mem_mb={peak.peak_mb - base_rss:.0f}")


if __name__ == "__main__":
    main()
