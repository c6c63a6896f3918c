"""The Hugging Face sampler with its LoRA adapter folded into the sampler's weights and without, side by
side: the same prompts and seeds, the two engines taking turns, so the machine's state weighs on both alike.

    python bench/sampler.py [--model smollm2-135m-instruct] [--prompts 4] [--generations 8] [--repeats 3]

Per engine: seconds a batch (the median) and the model FLOPs sampling needs (worker/algos/flops.py: each
prompt prefilled once per group) over them, against a matmul peak measured here. `same_tokens` says
whether the two drew the same completions (they differ only where rounding decides a draw).
Ends with: RESULT unfolded_s=... folded_s=... ratio=... mfu_unfolded=... mfu_folded=... same_tokens=...
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from service.core.settings import get_settings
from service.core.specs import DatasetSpec, LoraSpec, ModelSpec
from worker.batch import SamplingParams
from worker.datasets import ARITH_INSTRUCTION, arith, render_example
from worker.engines.hf_engine import HFEngine
from worker.loops.utilisation import sampling_flops
from worker.machine.hardware import decoder_shape, peak_flops
from worker.model.loading import load_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    spec = ModelSpec(name=args.model, lora=LoraSpec(r=args.lora_r))
    model, tok = load_policy(spec, models_root=get_settings().models_dir, device="cpu", seed=0)
    with torch.no_grad():  # a trained adapter: B away from its zero start
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    engines = {"unfolded": HFEngine(model, tok, "cpu", params), "folded": HFEngine(model, tok, "cpu", params, fold=True)}
    assert engines["folded"].folded is not None, "this model's adapter cannot be folded"
    train, _ = arith(DatasetSpec(name="arith"))
    shape, peak = decoder_shape(model), peak_flops(torch.device("cpu"), torch.float32)
    seconds: dict[str, list[float]] = {k: [] for k in engines}
    needed: dict[str, list[int]] = {k: [] for k in engines}
    same = True
    for r in range(args.repeats + 1):  # the first round warms both up and is not counted
        prompts = [render_example(tok, ex, ARITH_INSTRUCTION) for ex in train[r * args.prompts:(r + 1) * args.prompts]]
        seeds = [1000 * r + i for i in range(args.prompts)]
        drawn = {}
        for name, engine in sorted(engines.items(), reverse=bool(r % 2)):  # each goes first every other round
            t0 = time.perf_counter()
            batch = engine.generate(prompts, args.generations, seeds=seeds)
            dt = time.perf_counter() - t0
            drawn[name] = batch.completions
            if r:
                seconds[name].append(dt)
                needed[name].append(sampling_flops(shape, batch, args.generations))
        same &= drawn["unfolded"] == drawn["folded"]
        if r:
            print(f"round {r}: " + ", ".join(f"{k} {seconds[k][-1]:.2f} s" for k in engines))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    mfu = {k: sum(needed[k]) / sum(seconds[k]) / peak for k in engines}
    print(f"peak {peak / 1e9:.0f} GFLOP/s; {args.model}, LoRA r={args.lora_r}, {args.prompts} prompts x "
          f"{args.generations} completions of up to {args.max_new_tokens} tokens")
    print(f"RESULT unfolded_s={med['unfolded']:.3f} folded_s={med['folded']:.3f} "
          f"ratio={med['folded'] / med['unfolded']:.3f} mfu_unfolded={mfu['unfolded']:.3f} "
          f"mfu_folded={mfu['folded']:.3f} same_tokens={same}")


if __name__ == "__main__":
    main()
