"""One GRPO step split into rollout (sampling + scoring), old log-probs and training, measured
side by side on the same batch, with tokens per second and peak memory.

    python bench/step.py [--model smollm2-135m-instruct] [--device cpu] [--prompts 4] [--generations 8] [--dtype auto]
    python bench/step.py --short        # the tiny model, one step: what CI runs

With one epoch per rollout batch the loop takes old_logp from the first training forward, so
`step_s` = rollout + training; the separate old-log-prob pass (needed from the second epoch on) is
timed too, as `old_logp_s`. Each phase's model FLOPs (worker/algos/flops.py: a prompt prefilled once
per group) over its time, against a matmul peak measured here in the model's dtype, is its MFU; the
bytes sampling must read (the weights once a decode position of the batch, each row's cached keys and
values once a position) over its time, against a large read's rate here, is its MBU: decoding is bound
by memory bandwidth, so MBU is how near the sampler is to its limit.
Ends with: RESULT step_s=... rollout_share=... tokens_per_s=... peak_mem_mb=... mfu_sampling=... mfu_train=... mbu_sampling=...
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from rss import high_water_mb  # bench/ is on the path when a bench runs

from service.core.settings import get_settings
from service.core.specs import GRPOJob
from worker.loops.setup import build
from worker.loops.skeleton import Run
from worker.loops.sources import collect_train_rollouts
from worker.loops.update import train_epochs
from worker.loops.utilisation import forward_flops, sampling_bytes, sampling_flops, train_flops
from worker.machine.hardware import decoder_shape, peak_bandwidth, peak_flops
from worker.reporting import Reporter


def peak_mem_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return high_water_mb()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lora-r", type=int, default=16, help="0 for full fine-tuning")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="model.dtype: float32, bfloat16 or auto")
    ap.add_argument("--short", action="store_true", help="the tiny model, 2 x 2 rows, 8 tokens, one step: a check")
    args = ap.parse_args()
    if args.short:
        args.model, args.prompts, args.generations, args.max_new_tokens, args.repeats = "tiny-random-llama", 2, 2, 8, 1

    spec = GRPOJob.model_validate({
        "model": {"name": args.model, "dtype": args.dtype, "lora": {"r": args.lora_r} if args.lora_r else None},
        "dataset": {"name": "arith"}, "devices": {"policy": args.device},
        "grpo": {"steps": args.repeats + 1, "prompts_per_step": args.prompts, "num_generations": args.generations,
                 "max_new_tokens": args.max_new_tokens, "micro_batch_size": args.prompts * args.generations,
                 "learning_rate": 1e-4},
    })
    reporter = Reporter()
    reporter.checkpoint_root = Path(tempfile.mkdtemp(prefix="grpo-bench-step-"))
    s = build(spec, get_settings(), reporter)
    run = Run(s, reporter, evaluate=lambda step: {})
    collect_train_rollouts(s, 0, reporter)  # warm-up: allocator, kernels, tokenizer caches

    shape = decoder_shape(s.model)
    peak = peak_flops(s.device, next(s.model.parameters()).dtype)
    rows = []
    for step in range(1, args.repeats + 1):
        torch.manual_seed(step)
        t0 = time.perf_counter()
        s.engine.sync(s.model)
        ro = collect_train_rollouts(s, step, reporter)
        t1 = time.perf_counter()
        s.engine.logprobs(ro.batch, spec.grpo.micro_batch_size)  # timed only: a step runs it only for a model with dropout
        t2 = time.perf_counter()
        train_epochs(run, ro, None, None, step)
        t3 = time.perf_counter()
        tokens = int(ro.batch.completion_mask.sum())
        read = sampling_bytes(shape, s.model, ro.batch, args.generations)
        fl = {"sampling": sampling_flops(shape, ro.batch, args.generations),
              "old_logp": forward_flops(shape, ro.batch, list(range(len(ro.batch)))),
              "train": train_flops(shape, ro.batch, ro.train_rows, epochs=1, frozen_base=bool(args.lora_r),
                                   old_pass=False, ref_pass=False)}
        rows.append({"rollout": t1 - t0, "old_logp": t2 - t1, "train": t3 - t2, "tokens": tokens, "flops": fl,
                     "read": read})
        print(f"step {step}: rollout {t1 - t0:.2f} s, old log-probs {t2 - t1:.2f} s, train {t3 - t2:.2f} s, "
              f"{tokens} completion tokens")

    n = len(rows)
    rollout = sum(r["rollout"] for r in rows) / n
    old = sum(r["old_logp"] for r in rows) / n
    train = sum(r["train"] for r in rows) / n
    tokens = sum(r["tokens"] for r in rows) / n
    step_s = rollout + train
    mfu = {phase: sum(r["flops"][phase] for r in rows) / sum(r[key] for r in rows) / peak
           for phase, key in (("sampling", "rollout"), ("old_logp", "old_logp"), ("train", "train"))}
    bandwidth = peak_bandwidth(s.device)
    mbu = sum(r["read"] for r in rows) / sum(r["rollout"] for r in rows) / bandwidth
    print(f"peak {peak / 1e9:.0f} GFLOP/s (a matmul here); model FLOPs utilisation: sampling {mfu['sampling']:.0%} "
          f"(with scoring in its time), old log-probs {mfu['old_logp']:.0%}, train {mfu['train']:.0%}")
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (a large read here); model bandwidth utilisation: sampling "
          f"{mbu:.0%} (the weights once a decode position, each row's cache once a position)")
    print(f"{args.model} on {args.device}, P={args.prompts} G={args.generations}, max_new_tokens={args.max_new_tokens}: "
          f"rollout {rollout:.2f} s, train {train:.2f} s, old_logp_s {old:.2f} s (not in the step at one epoch)")
    print(f"RESULT step_s={step_s:.3f} rollout_share={rollout / step_s:.3f} tokens_per_s={tokens / step_s:.1f} "
          f"peak_mem_mb={peak_mem_mb(args.device):.0f} old_logp_s={old:.3f} peak_gflops={peak / 1e9:.1f} "
          f"mfu_sampling={mfu['sampling']:.3f} mfu_old_logp={mfu['old_logp']:.3f} mfu_train={mfu['train']:.3f} "
          f"peak_read_gbps={bandwidth / 1e9:.1f} mbu_sampling={mbu:.3f}")


if __name__ == "__main__":
    main()
