"""The teacher-forced forward with a group's prompt computed once against one forward per row, side by
side on the same rollout batch: training (forward and backward of the policy's log-probs, micro-batch by
micro-batch) and no-grad log-probs (old or reference), the two ways taking turns each round.

    python bench/prefix.py [--model smollm2-135m-instruct] [--prompts 4] [--generations 8] [--repeats 5]

The defaults are the matched spec's (bench/specs/matched-trl.yaml: LoRA r=16, 4 prompts x 8 completions of
up to 24 tokens, micro-batches of 16 rows). Gradients agree to rounding (tests/worker/model/test_prefix.py).
Ends with: RESULT train_per_row_s=... train_shared_s=... train_ratio=... logp_per_row_s=... logp_shared_s=...
logp_ratio=... positions_per_row=... positions_shared=...
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from service.core.settings import get_settings
from service.core.specs import GRPOJob
from worker.loops.setup import build
from worker.loops.sources import collect_train_rollouts
from worker.loops.update import micro
from worker.model.forward import batch_logprobs, sequence_logprobs
from worker.model.prefix import prompt_groups
from worker.reporting import Reporter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    spec = GRPOJob.model_validate({
        "model": {"name": args.model, "lora": {"r": 16, "alpha": 32}}, "dataset": {"name": "arith"},
        "grpo": {"steps": 1, "prompts_per_step": args.prompts, "num_generations": args.generations,
                 "max_new_tokens": args.max_new_tokens, "micro_batch_size": args.micro_batch_size},
    })
    reporter = Reporter()
    reporter.checkpoint_root = Path(tempfile.mkdtemp(prefix="grpo-bench-prefix-"))
    s = build(spec, get_settings(), reporter)
    ro = collect_train_rollouts(s, 1, reporter)
    batch, rows = ro.batch, micro(s, ro.batch, list(range(len(ro.batch))))
    T = spec.grpo.temperature

    def train(share: bool) -> float:
        s.model.train()
        s.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for idx in rows:
            logp, _ = sequence_logprobs(s.model, batch.select(idx), T, with_entropy=True, share_prompts=share)
            logp.sum().backward()
        return time.perf_counter() - t0

    def logprobs(share: bool) -> float:
        t0 = time.perf_counter()
        batch_logprobs(s.model, batch, T, rows, "cpu", share_prompts=share)
        return time.perf_counter() - t0

    seconds: dict[tuple[str, bool], list[float]] = {(k, sh): [] for k in ("train", "logp") for sh in (False, True)}
    for r in range(args.repeats + 1):  # the first round warms up and is not counted
        for share in ((False, True) if r % 2 else (True, False)):  # each way goes first every other round
            dt = train(share), logprobs(share)
            if r:
                seconds["train", share].append(dt[0])
                seconds["logp", share].append(dt[1])
        if r:
            print(f"round {r}: " + ", ".join(f"{k} {'shared' if sh else 'per row'} {v[-1]:.2f} s"
                                             for (k, sh), v in seconds.items()))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    P, t = batch.prompt_mask.sum(1), batch.completion_mask.sum(1)  # [N] each
    per_row = int((P + t).sum())
    groups = prompt_groups(batch.prompt_ids, batch.prompt_mask)
    shared = int(P[groups.first].sum() + t.sum()) if groups is not None else per_row
    print(f"{args.model}, LoRA r=16, {args.prompts} prompts x {args.generations} completions of up to "
          f"{args.max_new_tokens} tokens, micro-batches of {args.micro_batch_size}: {per_row} positions a forward per "
          f"row, {shared} with each prompt once; {torch.get_num_threads()} threads")
    print(f"RESULT train_per_row_s={med['train', False]:.3f} train_shared_s={med['train', True]:.3f} "
          f"train_ratio={med['train', True] / med['train', False]:.3f} logp_per_row_s={med['logp', False]:.3f} "
          f"logp_shared_s={med['logp', True]:.3f} logp_ratio={med['logp', True] / med['logp', False]:.3f} "
          f"positions_per_row={per_row} positions_shared={shared}")


if __name__ == "__main__":
    main()
