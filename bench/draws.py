"""One token per row drawn from [rows, vocab] probabilities with each row's own generator, two ways, side
by side: `torch.multinomial` a row at a time (the exponential race: one exponential variate per vocabulary
entry) against the inverse-CDF draw the sampler uses (worker/algos/draws.py: one uniform per row, one
batched float64 cumulative sum and search). SmolLM2's vocabulary and the matched spec's 32 rows by default.

    python bench/draws.py [--rows 32] [--vocab 49152] [--repeats 200]

Ends with: RESULT multinomial_ms=... inverse_cdf_ms=... ratio=... (per token, the median over repeats)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from worker.algos.draws import inverse_cdf, uniforms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(args.rows, args.vocab, generator=g) * 3, dim=-1)  # [B, V], peaked like an LM's
    gens = [torch.Generator().manual_seed(s) for s in range(args.rows)]

    def multinomial() -> None:
        torch.cat([torch.multinomial(probs[i], 1, generator=gen) for i, gen in enumerate(gens)])

    def inverse() -> None:
        inverse_cdf(probs, uniforms(gens, "cpu"))

    ms: dict[str, list[float]] = {"multinomial": [], "inverse_cdf": []}
    for r in range(args.repeats + 5):  # the first rounds warm up; the two take turns going first
        for name, fn in sorted({"multinomial": multinomial, "inverse_cdf": inverse}.items(), reverse=bool(r % 2)):
            t0 = time.perf_counter()
            fn()
            if r >= 5:
                ms[name].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"{args.rows} rows x {args.vocab} tokens, {torch.get_num_threads()} threads, {args.repeats} draws each")
    print(f"RESULT multinomial_ms={med['multinomial']:.3f} inverse_cdf_ms={med['inverse_cdf']:.3f} "
          f"ratio={med['inverse_cdf'] / med['multinomial']:.3f}")


if __name__ == "__main__":
    main()
