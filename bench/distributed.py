"""A GRPO job as 1 and as 2 data-parallel processes on the same global batch, side by side: a
step's time, each rank's peak memory while training, and the share of the step spent in
collectives.

    python bench/distributed.py [--model smollm2-135m-instruct] [--lora-r 16] [--prompts 4] [--steps 3]
    python bench/distributed.py --lora-r 0 --sharding fsdp     # full fine-tuning, FSDP2 at 2 ranks

Both runs go through the same elastic launch (1 rank, then 2) and the same loop; time in
collectives is measured by timing torch.distributed's calls inside each rank, FSDP2's
all-gathers and reduce-scatters included (a call that returns before its transfer ends counts
only until then, so the share is a lower bound).
The first step (allocator warm-up) is left out of the step time, and peak memory is taken from
the end of step 1 on (loading the model is not training). Ends with:
RESULT step_s_1=... step_s_2=... speedup=... comm_share_2=... peak_mb_rank_1=... peak_mb_rank_2=... mem_ratio=...
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import wraps
from pathlib import Path

import torch.distributed as dist
from pydantic import TypeAdapter
from rss import PeakRss  # bench/ is on the path when a bench runs

from service.core.settings import get_settings
from service.core.specs import JobSpec
from worker.jobs.runner import loop_for
from worker.parallel.launch import launch
from worker.reporting import FileReporter, RankReporter

# ours (worker/parallel/distributed.py) and FSDP2's (all_gather_single, reduce_scatter_single)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast_object_list", "barrier",
               "all_gather_single", "reduce_scatter_single")
_in_collectives = [0.0]


def _timed(fn):
    @wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _in_collectives[0] += time.perf_counter() - t0
    return wrapper


class PeakAfterFirstStep(RankReporter):
    """Starts the peak-memory window when step 1 ends, on every rank."""

    def __init__(self, inner, ranks, peak: PeakRss) -> None:
        super().__init__(inner, ranks)
        self.peak = peak

    def progress(self, step):
        super().progress(step)
        if step == 1:
            self.peak.arm()


def rank_main(spec: dict, out: str, *, ranks) -> dict:
    """One rank: the loop, with torch.distributed's collectives timed."""
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _timed(getattr(dist, name)))
    job = TypeAdapter(JobSpec).validate_python(spec)
    t0 = time.perf_counter()
    with PeakRss(every_s=0.05) as peak:
        reporter = PeakAfterFirstStep(FileReporter(Path(out)) if ranks.main else None, ranks, peak)
        loop_for(job.kind)(job, reporter, settings=get_settings(), ranks=ranks)
    return {"comm_s": _in_collectives[0], "wall_s": time.perf_counter() - t0, "peak_mb": peak.peak_mb}


def run(spec: dict, processes: int, sharding: str) -> dict:
    resources = {"processes": processes, **({"sharding": sharding} if processes > 1 else {})}
    with tempfile.TemporaryDirectory() as out:
        per_rank = launch(rank_main, ({**spec, "resources": resources}, out), processes=processes)
        lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [m["metrics"]["time/step_s"] for m in lines if m["step"] > 1 and "time/step_s" in m["metrics"]]
    return {"step_s": statistics.mean(steps),
            "comm_share": max(r["comm_s"] / r["wall_s"] for r in per_rank.values()),
            "peak_mb": max(r["peak_mb"] for r in per_rank.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lora-r", type=int, default=16, help="0 for full fine-tuning")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sharding", choices=["none", "fsdp"], default="none", help="of the 2-process run")
    args = ap.parse_args()
    spec = {"kind": "grpo", "model": {"name": args.model, "lora": {"r": args.lora_r} if args.lora_r else None},
            "dataset": {"name": "arith"},
            "grpo": {"steps": args.steps, "prompts_per_step": args.prompts, "num_generations": args.generations,
                     "max_new_tokens": args.max_new_tokens, "micro_batch_size": 8, "eval_prompts": 2,
                     "eval_every": 0, "checkpoint_every": 0, "samples_per_step": 0}}
    if args.lora_r == 0:
        spec["grpo"]["kl_coef"] = 0.04  # full fine-tuning keeps a frozen reference copy
    one, two = run(spec, 1, "none"), run(spec, 2, args.sharding)
    for n, r in ((1, one), (2, two)):
        print(f"{n} process(es): {r['step_s']:.1f} s/step, {100 * r['comm_share']:.1f}% in collectives, "
              f"peak {r['peak_mb']:.0f} MB per rank")
    print(f"RESULT step_s_1={one['step_s']:.2f} step_s_2={two['step_s']:.2f} speedup={one['step_s'] / two['step_s']:.3f} "
          f"comm_share_2={two['comm_share']:.4f} peak_mb_rank_1={one['peak_mb']:.0f} peak_mb_rank_2={two['peak_mb']:.0f} "
          f"mem_ratio={two['peak_mb'] / one['peak_mb']:.3f}")


if __name__ == "__main__":
    main()
