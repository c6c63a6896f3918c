"""TracIn benchmark, measured side by side in one run.

1. Scoring, on one training batch and one validation batch: the ghost hooks (one batched backward)
   against naive per-sample autograd (one backward per sample through the same batched forward):
   time and the largest relative error of the hook scores. For reference it also times a forward
   and backward per sample on its own (a batch of one, padding trimmed): the same arithmetic as one
   batched pass, so what it costs over the hooks is only the lost batching, which on a CPU is small
   and on a GPU is most of the cost.
2. A step of the real TracIn loop against a step of the real GRPO loop on the same settings and
   seed, each loop in its own process so that each one's peak memory is its own; each loop twice, with
   a group's prompt run once (`grpo.share_prompts`, the default: TracIn takes each row's part of the
   prompt's gradient from leaves of its own, worker/model/prefix.py) and with one forward per row
   (`share_prompts: false`). `step_ratio` is what TracIn costs a user against GRPO, `*_unshared` TracIn
   against one-forward-per-row GRPO (what the influence adds on its own), and `*_tracin_unshared` TracIn
   without shared prompts against GRPO (what sharing them saves TracIn).

    python bench/tracin.py [--model smollm2-135m-instruct] [--prompts 8] [--generations 8] [--dtype auto]

The default batch is N = 8 x 8 = 64 completions (the demo's is 4 x 8); the loops run it in
micro-batches of 8 (the spec's default). One naive per-sample backward through the batched graph
costs a whole batch's backward, so the speedup over it grows with N: about 0.4 N on a 2-core CPU.
The loops' extra cost for TracIn is mostly fixed per step (the validation batch), so their ratio
falls as N grows.

The three scoring methods are timed interleaved in rounds after one untimed warm-up pass, and the
loops take turns step by step (see `scoring` and `lockstep`), so that both sides of each ratio
see the same machine state: on this VM, timings of the same pass drifted up to 2x over minutes.
`--scoring-only` skips part 2.

Ends with: RESULT speedup_vs_naive=... max_rel_err=... step_ratio=... mem_ratio=... step_ratio_unshared=...
mem_ratio_unshared=... step_ratio_tracin_unshared=... mem_ratio_tracin_unshared=...
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rss import PeakRss, high_water_mb  # bench/ is on the path when a bench runs

from service.core.settings import get_settings
from service.core.specs import TracInJob
from worker.algos.influence import influence_scores
from worker.algos.lora import lora_layers
from worker.algos.losses import Normaliser, sample_losses
from worker.loops.rollouts import collect_rollouts
from worker.loops.setup import build
from worker.loops.sources import collect_train_rollouts, draw_prompts
from worker.machine import allocator
from worker.model.forward import sequence_logprobs
from worker.reporting import Reporter

LOOPS = ("grpo", "grpo-unshared", "tracin", "tracin-unshared")  # the processes `lockstep` runs, in turns


def job(args, kind: str, steps: int) -> dict:
    """The spec of one loop: `kind` is one of LOOPS."""
    spec = {
        "kind": kind.removesuffix("-unshared"),
        "model": {"name": args.model, "dtype": args.dtype, "lora": {"r": args.lora_r}},
        "dataset": {"name": "arith"},
        # a graded reward beside the exact one, so advantages (and scores) are rarely all zero
        "rewards": [{"name": "numeric_match"}, {"name": "rouge_l", "weight": 0.2}],
        "grpo": {"steps": steps, "prompts_per_step": args.prompts, "num_generations": args.generations,
                 "max_new_tokens": args.max_new_tokens, "micro_batch_size": args.micro_batch,
                 "learning_rate": 1e-4, "temperature": 1.0, "eval_prompts": 1, "samples_per_step": 0,
                 "share_prompts": not kind.endswith("-unshared")},
    }
    if kind.startswith("tracin"):
        spec["tracin"] = {"val_prompts": args.val_prompts, "val_generations": args.val_generations,
                          "val_regenerate_every": args.val_regenerate_every, "score": args.score}
    return spec


class Capture(Reporter):
    """Keeps each step's metrics; after each step tells the parent and waits for its turn."""

    def __init__(self, rss: PeakRss, last_step: int):
        self.checkpoint_root = Path(tempfile.mkdtemp(prefix="grpo-bench-tracin-"))
        self.steps = {}
        self.rss = rss
        self.last_step = last_step

    def metrics(self, step, values):
        self.steps[step] = values
        if step == 1:  # from here on: training steps only
            self.rss.arm()
        say({"step": step})
        if step < self.last_step:
            sys.stdin.readline()  # the other loop's step runs now


def say(obj: dict) -> None:
    print(MARK + json.dumps(obj), flush=True)


MARK = "@bench "  # the lines meant for the parent; libraries may print other things


def child(args) -> None:
    """Run the real loop of one kind in turns with the other; report mean step time (eval steps
    excluded) and peak RSS."""
    from pydantic import TypeAdapter

    from service.core.specs import JobSpec
    from worker.jobs.runner import loop_for

    spec = TypeAdapter(JobSpec).validate_python(job(args, args.child, args.loop_steps))
    rss = PeakRss(every_s=0.02).start()
    rep = Capture(rss, args.loop_steps)
    loop_for(spec.kind)(spec, rep, settings=get_settings())
    measured = range(2, args.loop_steps)  # 1: warm-up; last: eval
    mean = {k: sum(rep.steps[s].get(k, 0.0) for s in measured) / len(measured)
            for k in ("time/step_s", "time/rollout_s", "time/train_s", "tracin/time_s")}
    say({"step_s": mean["time/step_s"], "breakdown": mean, "peak_mb": rss.peak_mb,
         "per_step": [rep.steps[s]["time/step_s"] for s in measured],
         "process_peak_mb": high_water_mb()})


def losses_fn(s, ro):
    g = s.spec.grpo
    norm = Normaliser.of(ro.loss_mask, g.loss_agg)

    def f():
        logp, _ = sequence_logprobs(s.model, ro.batch, g.temperature)
        return sample_losses(logp, logp.detach(), ro.advantages, ro.loss_mask, norm).loss

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
    s = build(spec, get_settings(), rep)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter, not B = 0: both factors' gradients matter
        for layer in lora_layers(s.model):
            layer.b.weight.normal_(0, 1e-3)
    for step in range(1, 21):  # a batch pair whose advantages are not all zero, or every score is 0
        ro = collect_train_rollouts(s, step, rep)
        draw_val = draw_prompts(s, s.task.val, args.val_generations, seed_tag=f"prompts-val-{spec.grpo.seed}-{step}")
        val = collect_rollouts(s, step, rep, draw_val, units=args.val_prompts, group_size=args.val_generations)
        if ro.advantages.abs().sum() > 0 and val.advantages.abs().sum() > 0:
            break
    s.model.train()
    train_f, val_f = losses_fn(s, ro), losses_fn(s, val)
    params = [p for layer in lora_layers(s.model) for p in (layer.a.weight, layer.b.weight)]
    g = s.spec.grpo
    n, norm = len(ro.batch), Normaliser.of(ro.loss_mask, g.loss_agg)

    def ghost_pass() -> torch.Tensor:
        return influence_scores(s.model, train_f, lambda: val_f().sum())

    def single(i: int) -> torch.Tensor:
        """Sample i's gradient from a batch of one, normalised as in the whole batch's loss."""
        one = trimmed(ro.batch, i)
        logp, _ = sequence_logprobs(s.model, one, g.temperature)
        loss = sample_losses(logp, logp.detach(), ro.advantages[i:i + 1], ro.loss_mask[i:i + 1, :logp.shape[1]],
                             norm).loss
        return torch.autograd.grad(loss.sum(), params)

    ghost_pass()  # warm-up: first-call allocations and kernel choices for these shapes, untimed
    # This VM's speed drifts by up to 2x over minutes, so the three methods are timed interleaved,
    # round after round: a hooks pass; the naive batched forward and the next chunk of its
    # per-sample backward passes; the same samples as batches of one. Naive's graph is dropped
    # before the next hooks pass (held alongside, its memory slowed that pass by up to 1.5x), so
    # naive's time counts one forward (the median of its rounds) and every backward.
    clock = time.perf_counter
    t0 = clock()
    g_val = torch.autograd.grad(val_f().sum(), params)  # what both per-sample methods compare against
    naive_s = single_s = clock() - t0
    ghost_times, forward_times, naive, one = [], [], [], []
    for chunk in torch.arange(n).chunk(args.rounds):
        t0 = clock()
        ghost = ghost_pass()
        ghost_times.append(clock() - t0)
        t0 = clock()
        losses = train_f()  # [N], one batched forward whose graph every per-sample backward reuses
        forward_times.append(clock() - t0)
        t0 = clock()
        for k, i in enumerate(chunk.tolist()):
            naive.append(dot(torch.autograd.grad(losses[i], params, retain_graph=k < len(chunk) - 1), g_val))
        naive_s += clock() - t0
        del losses
        t0 = clock()
        for i in chunk.tolist():
            one.append(dot(single(i), g_val))
        single_s += clock() - t0
    naive_s += sorted(forward_times)[len(forward_times) // 2]
    ghost_s = sorted(ghost_times)[len(ghost_times) // 2]
    naive, one = torch.stack(naive), torch.stack(one)
    if not (naive != 0).any():
        raise SystemExit("no batch with non-zero advantages in 20 tries: every score is 0")
    nz = naive.abs() > 1e-12 * naive.abs().max()
    rel = ((ghost - naive).abs()[nz] / naive.abs()[nz]).max().item() if nz.any() else 0.0
    rel_single = ((one - naive).abs()[nz] / naive.abs()[nz]).max().item() if nz.any() else 0.0
    print(f"  hooks passes: {', '.join(f'{t:.2f}' for t in ghost_times)} s; naive forwards: "
          f"{', '.join(f'{t:.2f}' for t in forward_times)} s", flush=True)
    return ghost_s, naive_s, rel, single_s, rel_single, n


def lockstep(args) -> dict[str, dict]:
    """Run the LOOPS in a process each (each one's peak memory its own), taking turns step by step so
    that all of them see the same machine speed; returns each one's report."""
    procs = {kind: subprocess.Popen([sys.executable, __file__, "--child", kind, *sys.argv[1:]], text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for kind in LOOPS}

    def wait(kind: str) -> dict:
        for line in procs[kind].stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise SystemExit(f"the {kind} loop exited with {procs[kind].wait()}")

    for kind in procs:
        wait(kind)  # all loaded and evaluated (step 0); from here on one runs at a time
    for step in range(1, args.loop_steps + 1):
        order = list(procs) if step % 2 else list(reversed(procs))  # alternate who goes first and last
        for kind in order:
            procs[kind].stdin.write("go\n")
            procs[kind].stdin.flush()
            wait(kind)
    runs = {kind: wait(kind) for kind in procs}
    for p in procs.values():
        p.wait()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "auto", "bfloat16"],
                    help="model.dtype of every loop (auto: bfloat16 base weights where the CPU multiplies them natively)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--micro-batch", type=int, default=8, help="The loops' micro_batch_size.")
    ap.add_argument("--val-prompts", type=int, default=2)
    ap.add_argument("--val-generations", type=int, default=4)
    ap.add_argument("--val-regenerate-every", type=int, default=4)
    ap.add_argument("--loop-steps", type=int, default=6)
    ap.add_argument("--score", default="auto", choices=["auto", "sgd", "adam", "adam_fixed_state", "adam_prior_state"],
                    help="tracin.score of the TracIn loop (sgd streams positive's factors micro-batch by micro-batch)")
    ap.add_argument("--rounds", type=int, default=4, help="Hooks passes interleaved with the per-sample ones.")
    ap.add_argument("--scoring-only", action="store_true", help="Only part 1 (hooks vs naive).")
    ap.add_argument("--loops-only", action="store_true", help="Only part 2 (the loops: GRPO and TracIn, each with "
                    "shared prompts and with one forward per row).")
    ap.add_argument("--child", choices=LOOPS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    if args.loops_only:
        print(f"RESULT {report_loops(args, lockstep(args))}")
        return
    ghost_s, naive_s, rel, single_s, rel_single, n = scoring(args)
    print(f"scoring {n} samples: hooks {ghost_s:.2f} s, naive per-sample autograd {naive_s:.2f} s "
          f"({naive_s / ghost_s:.1f}x), max relative error {rel:.2e}")
    print(f"  for reference, a forward and backward per sample alone (batch of one): {single_s:.2f} s "
          f"({single_s / ghost_s:.1f}x the hooks; max relative difference from naive {rel_single:.2e})")
    if args.scoring_only:
        print(f"RESULT speedup_vs_naive={naive_s / ghost_s:.1f} max_rel_err={rel:.2e}")
        return
    gc.collect()
    allocator.release_freed_memory()  # part 1's memory (its retained graphs) is not kept through part 2
    ratios = report_loops(args, lockstep(args))
    print(f"RESULT speedup_vs_naive={naive_s / ghost_s:.1f} max_rel_err={rel:.2e} {ratios}")


def report_loops(args, runs: dict[str, dict]) -> str:
    """Print each loop's timings; return the RESULT fields: TracIn's step and peak memory against GRPO's
    (`step_ratio`, `mem_ratio`) and against GRPO's without shared prompts (`*_unshared`)."""
    for kind, r in runs.items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown"].items() if v)
        print(f"{kind} loop: {r['step_s']:.2f} s/step ({parts}; steps {', '.join(f'{t:.1f}' for t in r['per_step'])}); "
              f"peak RSS during steps {r['peak_mb']:.0f} MB (whole process, model loading included: "
              f"{r['process_peak_mb']:.0f} MB)")
    print(f"settings: {args.model} {args.dtype} LoRA r={args.lora_r}, P={args.prompts} G={args.generations} "
          f"in micro-batches of {args.micro_batch}, "
          f"val {args.val_prompts}x{args.val_generations} regenerated every {args.val_regenerate_every} steps")
    return " ".join(f"step_ratio{tag}={runs[a]['step_s'] / runs[b]['step_s']:.3f} "
                    f"mem_ratio{tag}={runs[a]['peak_mb'] / runs[b]['peak_mb']:.3f}"
                    for a, b, tag in (("tracin", "grpo", ""), ("tracin", "grpo-unshared", "_unshared"),
                                      ("tracin-unshared", "grpo", "_tracin_unshared")))


if __name__ == "__main__":
    main()
