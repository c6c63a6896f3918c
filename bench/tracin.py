"""TracIn benchmark, measured side by side in one run.

1. Scoring, on one training batch and one validation batch: the ghost hooks (one batched backward)
   against naive per-sample autograd (one backward per sample through the same batched forward):
   time and the largest relative error of the hook scores. For reference it also times a forward
   and backward per sample on its own (a batch of one, padding trimmed): the same arithmetic as one
   batched pass, so what it costs over the hooks is only the lost batching, which on a CPU is small
   and on a GPU is most of the cost.
2. A step of the real TracIn loop against a step of the real GRPO loop on the same settings and
   seed, each loop in its own process so that each one's peak memory is its own.

    python bench/tracin.py [--model smollm2-135m-instruct] [--prompts 4] [--generations 8]

The default batch is the demo's, N = 4 x 8 = 32 completions; the loops run it in micro-batches of
8 (the spec's default). One naive per-sample backward through the batched graph costs a whole
batch's backward, so the speedup over it grows with N (about 0.45 N on a 2-core CPU): 20x needs
N >= 45, and part 1 holds the whole batch's graph at once (N = 64 takes ~23 GB of memory).

Both scoring methods run after one untimed warm-up pass; the hooks' time is the median of three passes. `--scoring-only` skips part 2.

Ends with: RESULT speedup_vs_naive=... max_rel_err=... step_ratio=... mem_ratio=...
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from service.settings import get_settings
from service.specs import TracInJob
from worker.algos.influence import influence_scores, lora_layers
from worker.algos.losses import per_sample_loss
from worker.loops import steps as S
from worker.reporting import Reporter
from worker.rollout import sequence_logprobs


def job(args, kind: str, steps: int) -> dict:
    spec = {
        "kind": kind,
        "model": {"name": args.model, "lora": {"r": args.lora_r}},
        "dataset": {"name": "arith"},
        # a graded reward beside the exact one, so advantages (and scores) are rarely all zero
        "rewards": [{"name": "numeric_match"}, {"name": "rouge_l", "weight": 0.2}],
        "grpo": {"steps": steps, "prompts_per_step": args.prompts, "num_generations": args.generations,
                 "max_new_tokens": args.max_new_tokens, "micro_batch_size": args.micro_batch,
                 "learning_rate": 1e-4, "temperature": 1.0, "eval_prompts": 1, "samples_per_step": 0},
    }
    if kind == "tracin":
        spec["tracin"] = {"val_prompts": args.val_prompts, "val_generations": args.val_generations,
                          "val_regenerate_every": args.val_regenerate_every}
    return spec


class PeakRSS(threading.Thread):
    """Samples this process's resident memory every 20 ms; `arm()` restarts the peak, so loading and
    converting the model (whose peak is the same for both loops) does not hide the steps' own peak."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0
        self.page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def arm(self):
        self.peak = self.rss()

    def run(self):
        while True:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.02)


class Capture(Reporter):
    def __init__(self, rss: PeakRSS):
        self.checkpoint_root = Path(tempfile.mkdtemp(prefix="grpo-bench-tracin-"))
        self.steps = {}
        self.rss = rss

    def metrics(self, step, values):
        self.steps[step] = values
        if step == 1:  # from here on: training steps only
            self.rss.arm()


def child(args) -> None:
    """Run the real loop of one kind; print mean step time (eval steps excluded) and peak RSS."""
    from pydantic import TypeAdapter

    from service.specs import JobSpec
    from worker.runner import loop_for

    spec = TypeAdapter(JobSpec).validate_python(job(args, args.child, args.loop_steps))
    rss = PeakRSS()
    rss.start()
    rep = Capture(rss)
    loop_for(spec.kind)(spec, rep, settings=get_settings())
    measured = range(2, args.loop_steps)  # 1: warm-up; last: eval
    mean = {k: sum(rep.steps[s].get(k, 0.0) for s in measured) / len(measured)
            for k in ("time/step_s", "time/rollout_s", "time/train_s", "tracin/time_s")}
    print(json.dumps({"step_s": mean["time/step_s"], "breakdown": mean, "peak_mb": rss.peak / 2**20,
                      "process_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def losses_fn(s, ro):
    g = s.spec.grpo
    tokens, n = float(ro.loss_mask.sum()), len(ro.batch)

    def f():
        logp, _ = sequence_logprobs(s.model, ro.batch, g.temperature)
        return per_sample_loss(logp, logp.detach(), ro.advantages, ro.loss_mask, batch_tokens=tokens, batch_size=n)

    return f


def dot(grads, others) -> torch.Tensor:
    """<grads, others> over every LoRA weight, in float64."""
    return sum((a.double() * b.double()).sum() for a, b in zip(grads, others))


def trimmed(batch, i: int):
    """Row i alone, without the columns that are padding for it."""
    one = batch.select([i])
    p0 = int(one.prompt_mask[0].nonzero()[0])  # left padding of the prompt
    t1 = int(one.completion_mask[0].nonzero()[-1]) + 1 if one.completion_mask.any() else 1
    return type(one)(one.prompt_ids[:, p0:], one.prompt_mask[:, p0:], one.completion_ids[:, :t1],
                     one.completion_mask[:, :t1], one.truncated, one.completions)


def scoring(args) -> tuple[float, float, float, float, float, int]:
    spec = TracInJob.model_validate(job(args, "tracin", 1))
    rep = Reporter()
    rep.checkpoint_root = Path(tempfile.mkdtemp(prefix="grpo-bench-tracin-"))
    s = S.build(spec, get_settings(), rep)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter, not B = 0: both factors' gradients matter
        for _, _, b in lora_layers(s.model):
            b.weight.normal_(0, 1e-3)
    for step in range(1, 21):  # a batch pair whose advantages are not all zero, or every score is 0
        ro = S.collect_rollouts(s, step, rep)
        val = S.collect_rollouts(s, step, rep, examples_pool=s.task.val, prompts_per_step=args.val_prompts,
                                 group_size=args.val_generations, tag="val")
        if ro.advantages.abs().sum() > 0 and val.advantages.abs().sum() > 0:
            break
    s.model.train()
    train_f, val_f = losses_fn(s, ro), losses_fn(s, val)
    params = [p for _, a, b in lora_layers(s.model) for p in (a.weight, b.weight)]

    def ghost_pass() -> torch.Tensor:
        return influence_scores(s.model, train_f, lambda: val_f().sum())

    ghost_pass()  # warm-up: first-call allocations and kernel choices for these shapes, untimed
    times = []
    for _ in range(3):  # the median of three: one pass is short enough for a stray stall to double it
        t0 = time.perf_counter()
        ghost = ghost_pass()
        times.append(time.perf_counter() - t0)
    ghost_s = sorted(times)[1]

    t0 = time.perf_counter()
    g_val = torch.autograd.grad(val_f().sum(), params)
    losses = train_f()
    naive = []
    for i in range(losses.shape[0]):
        g_i = torch.autograd.grad(losses[i], params, retain_graph=i < losses.shape[0] - 1)
        naive.append(dot(g_i, g_val))
    naive_s = time.perf_counter() - t0
    naive = torch.stack(naive)

    # a batch of one per sample, normalised as in the whole batch's loss
    g = s.spec.grpo
    tokens, n = float(ro.loss_mask.sum()), len(ro.batch)
    t0 = time.perf_counter()
    g_val = torch.autograd.grad(val_f().sum(), params)
    single = []
    for i in range(n):
        one = trimmed(ro.batch, i)
        logp, _ = sequence_logprobs(s.model, one, g.temperature)
        loss = per_sample_loss(logp, logp.detach(), ro.advantages[i:i + 1], ro.loss_mask[i:i + 1, :logp.shape[1]],
                               batch_tokens=tokens, batch_size=n)
        g_i = torch.autograd.grad(loss.sum(), params)
        single.append(dot(g_i, g_val))
    single_s = time.perf_counter() - t0
    single = torch.stack(single)
    if not (naive != 0).any():
        raise SystemExit("no batch with non-zero advantages in 20 tries: every score is 0")
    nz = naive.abs() > 1e-12 * naive.abs().max()
    rel = ((ghost - naive).abs()[nz] / naive.abs()[nz]).max().item() if nz.any() else 0.0
    rel_single = ((single - naive).abs()[nz] / naive.abs()[nz]).max().item() if nz.any() else 0.0
    return ghost_s, naive_s, rel, single_s, rel_single, losses.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--micro-batch", type=int, default=8, help="The loops' micro_batch_size.")
    ap.add_argument("--val-prompts", type=int, default=2)
    ap.add_argument("--val-generations", type=int, default=4)
    ap.add_argument("--val-regenerate-every", type=int, default=4)
    ap.add_argument("--loop-steps", type=int, default=6)
    ap.add_argument("--scoring-only", action="store_true", help="Only part 1 (hooks vs naive).")
    ap.add_argument("--child", choices=["grpo", "tracin"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    ghost_s, naive_s, rel, single_s, rel_single, n = scoring(args)
    print(f"scoring {n} samples: hooks {ghost_s:.2f} s, naive per-sample autograd {naive_s:.2f} s "
          f"({naive_s / ghost_s:.1f}x), max relative error {rel:.2e}")
    print(f"  for reference, a forward and backward per sample alone (batch of one): {single_s:.2f} s "
          f"({single_s / ghost_s:.1f}x the hooks; max relative difference from naive {rel_single:.2e})")
    if args.scoring_only:
        print(f"RESULT speedup_vs_naive={naive_s / ghost_s:.1f} max_rel_err={rel:.2e}")
        return
    runs = {}
    for kind in ("grpo", "tracin"):
        out = subprocess.run([sys.executable, __file__, "--child", kind, *sys.argv[1:]], check=True,
                             capture_output=True, text=True).stdout
        runs[kind] = json.loads(out.strip().splitlines()[-1])
        r = runs[kind]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown"].items() if v)
        print(f"{kind} loop: {r['step_s']:.2f} s/step ({parts}); peak RSS during steps {r['peak_mb']:.0f} MB "
              f"(whole process, model loading included: {r['process_peak_mb']:.0f} MB)")
    print(f"settings: {args.model} LoRA r={args.lora_r}, P={args.prompts} G={args.generations} "
          f"in micro-batches of {args.micro_batch}, "
          f"val {args.val_prompts}x{args.val_generations} regenerated every {args.val_regenerate_every} steps")
    print(f"RESULT speedup_vs_naive={naive_s / ghost_s:.1f} max_rel_err={rel:.2e} "
          f"step_ratio={runs['tracin']['step_s'] / runs['grpo']['step_s']:.3f} "
          f"mem_ratio={runs['tracin']['peak_mb'] / runs['grpo']['peak_mb']:.3f}")


if __name__ == "__main__":
    main()
