"""What a bfloat16 base costs and buys, by what flows between its matmuls (`model.activations`), side by side
in one process: float32 weights; bfloat16 weights with bfloat16 activations (`weights`); bfloat16 weights
with float32 activations (`float32`, auto's choice on a CPU); and those with the LM head's matmul in float32
(`model.fp32_head`), whose logits are not rounded to bfloat16.

Numerics, against float32, on one batch sampled by the float32 policy (prompts x completions of the
matched spec's task), with the LoRA adapter's B factors set alike to N(0, b²) (b = 1e-3 is about ten
AdamW steps at lr 3e-4; 1e-2 a long run):
- `grad_cos`: the cosine of the adapter's gradient of a GRPO loss (group-normalised random advantages)
  with float32's;
- `logp_gap`: the mean |log-prob - float32's| a completion token;
- `effect_cos`: the cosine of the adapter's change of the log-probs (with B against B = 0) with float32's:
  how much of what the adapter learned the policy shows, rather than rounding;
- `sampler_cos`: the same for the sampler's folded copy (W0 + s·B·A in the weights' dtype, as a job samples
  and evaluates with it): a bfloat16 fold rounds the adapter's update into the weights once more.

Speed, each variant's own sampler (the folded copy, as a job samples) and training forward + backward
(worker/model/forward.py, shared prompts), the best of --repeats, interleaved so every variant sees the
same machine.

    python bench/precision.py                  # SmolLM2-135M, 8 prompts x 8 completions of 24 tokens
    python bench/precision.py --short          # the tiny model, one repeat: what CI runs

A benchmark, never a test. Ends with one line per variant:
RESULT variant=... b=... grad_cos=... logp_gap=... effect_cos=... sampler_cos=... decode_s=... train_s=... decode_ratio=... train_ratio=...
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from service.core.settings import get_settings
from service.core.specs import DatasetSpec, LoraSpec, ModelSpec
from worker.algos.lora import lora_layers
from worker.batch import RolloutBatch, SamplingParams
from worker.datasets import arith, render_example
from worker.engines.folded import FoldedSampler, foldable
from worker.engines.hf_engine import HFEngine
from worker.model.forward import sequence_logprobs
from worker.model.loading import load_policy


@dataclass(frozen=True)
class Variant:
    """What one side loads as: the ModelSpec fields that set its precision."""

    dtype: str
    activations: str
    fp32_head: bool = False


VARIANTS = {"float32": Variant("float32", "auto"), "bfloat16": Variant("bfloat16", "weights"),
            "bfloat16+float32-activations": Variant("bfloat16", "float32"),
            "bfloat16+float32-activations+fp32-head": Variant("bfloat16", "float32", fp32_head=True)}


@dataclass(frozen=True)
class Numerics:
    """One variant against float32, at one adapter size."""

    grad_cos: float
    logp_gap: float
    effect_cos: float
    sampler_cos: float


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def set_b(model: torch.nn.Module, std: float) -> None:
    """Every adapted layer's B factor to N(0, std²), from one generator: alike in every variant."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model):
            b = layer.b.weight
            b.copy_(torch.randn(b.shape, generator=g) * std)


def loss_and_grad(model: torch.nn.Module, batch: RolloutBatch, advantages: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [N, T], the adapter's gradient of -mean(advantage x logp) over tokens, flattened)."""
    model.zero_grad(set_to_none=True)
    logp, _ = sequence_logprobs(model, batch, temperature, share_prompts=True)
    (-(advantages[:, None] * logp).sum() / batch.completion_mask.sum()).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    return logp.detach(), grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24, help="new tokens a completion")
    ap.add_argument("--b", default="1e-3,1e-2", help="the adapter's B factors' scales to compare numerics at")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats a variant (the best is kept)")
    ap.add_argument("--short", action="store_true", help="the tiny model, 2 x 2 completions, one repeat")
    args = ap.parse_args()
    if args.short:
        args.model, args.prompts, args.generations, args.tokens, args.repeats = "tiny-random-llama", 2, 2, 8, 1
    settings = get_settings()
    temperature = 0.8
    params = SamplingParams(max_new_tokens=args.tokens, temperature=temperature)
    models, tok = {}, None
    for name, v in VARIANTS.items():
        spec = ModelSpec(name=args.model, dtype=v.dtype, activations=v.activations, fp32_head=v.fp32_head,
                         lora=LoraSpec(r=16, alpha=32))
        models[name], tok = load_policy(spec, models_root=settings.models_dir, device="cpu", seed=0)
    train, _ = arith(DatasetSpec(name="arith", difficulty=1))
    prompts = [render_example(tok, ex, "") for ex in train[:args.prompts]]
    seeds = list(range(args.prompts))
    G = args.generations
    batch = HFEngine(models["float32"], tok, "cpu", params).generate(prompts, G, seeds=seeds)
    adv = torch.randn(args.prompts, G, generator=torch.Generator().manual_seed(2))
    adv = ((adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-6)).flatten()  # [N]
    mask = batch.completion_mask.bool()

    numerics: dict[tuple[str, float], Numerics] = {}
    folds = {name: FoldedSampler(m, layers) for name, m in models.items() if (layers := foldable(m)) is not None}

    def logprobs(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return sequence_logprobs(model, batch, temperature, share_prompts=True)[0]

    for b in (float(x) for x in args.b.split(",")):
        runs, sampled = {}, {}
        for name, model in models.items():
            set_b(model, 0.0)
            base = logprobs(model)
            fold = folds.get(name)
            if fold is not None:
                fold.fold()
                base_sampler = logprobs(fold.model)
            set_b(model, b)
            logp, grad = loss_and_grad(model, batch, adv, temperature)
            runs[name] = (logp, grad, logp - base)
            if fold is not None:
                fold.fold()
                sampled[name] = logprobs(fold.model) - base_sampler
        ref = runs["float32"]
        for name, (logp, grad, effect) in runs.items():
            numerics[(name, b)] = Numerics(
                grad_cos=cosine(grad, ref[1]), logp_gap=float((logp - ref[0])[mask].abs().mean()),
                effect_cos=cosine(effect[mask], ref[2][mask]),
                sampler_cos=cosine(sampled[name][mask], ref[2][mask]) if name in sampled else float("nan"))
    del folds  # their weights, before the timed engines fold copies of their own

    engines = {name: HFEngine(m, tok, "cpu", params, fold=True) for name, m in models.items()}
    decode: dict[str, list[float]] = {name: [] for name in models}
    training: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):  # interleaved: each repeat times every variant once
        for name, model in models.items():
            engines[name].sync(model)
            t = time.perf_counter()
            engines[name].generate(prompts, G, seeds=seeds)
            decode[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            loss_and_grad(model, batch, adv, temperature)
            training[name].append(time.perf_counter() - t)

    best = {name: (min(decode[name]), min(training[name])) for name in models}
    print(f"{args.model}: {args.prompts} x {G} completions of up to {args.tokens} tokens, "
          f"{int(mask.sum())} completion tokens; {torch.get_num_threads()} threads")
    print(f"{'variant':30} {'b':>7} {'grad_cos':>9} {'logp_gap':>9} {'effect_cos':>10} {'sampler_cos':>11} "
          f"{'decode_s':>9} {'train_s':>8}")
    for (name, b), n in numerics.items():
        d, t = best[name]
        print(f"{name:30} {b:7.0e} {n.grad_cos:9.5f} {n.logp_gap:9.4f} {n.effect_cos:10.3f} {n.sampler_cos:11.3f} "
              f"{d:9.2f} {t:8.2f}")
    d32, t32 = best["float32"]
    for (name, b), n in numerics.items():
        d, t = best[name]
        print(f"RESULT variant={name} b={b:g} grad_cos={n.grad_cos:.5f} logp_gap={n.logp_gap:.4f} "
              f"effect_cos={n.effect_cos:.3f} sampler_cos={n.sampler_cos:.3f} decode_s={d:.2f} train_s={t:.2f} decode_ratio={d / d32:.3f} "
              f"train_ratio={t / t32:.3f}")


if __name__ == "__main__":
    main()
