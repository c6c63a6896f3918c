"""The device check: one script that prints one table of what decides whether a GRPO step is right
and fast on a machine's accelerator, for the docs (docs/development/device-check.md).

    python bench/device_check.py                 # cuda:0: SmolLM2-135M- and Qwen2.5-0.5B-shaped models
    python bench/device_check.py --short         # tiny shapes on the CPU, in seconds: what CI runs

It needs torch, transformers, peft and this checkout, nothing else of the service (worker/algos,
worker/engines/hf_engine and worker/machine/hardware import with those alone), and downloads nothing: the models
are randomly initialised from the shapes of the real ones (SHAPES), so weights are not needed, and the
numbers are the kernels' and the shapes', not a trained model's. Rows:

    agreement      a GRPO step (the chunked head's log-probs, the clipped surrogate, AdamW on LoRA) on the
                   device against the same step on the CPU in fp32: log-probs before and after, and the loss
    bf16           bf16 weights against the same weights in fp32 on the device: log-prob error, and a
                   row's drift between being scored alone and batched with longer rows (the reason the
                   first epoch's own forward gives the old log-probs, so the step-0 ratio is exactly 1)
    ratio          the first epoch's ratio, computed as the loop computes it: exactly 1 in any dtype
    fp32 head      bf16 weights with the LM head's matmul in float32 (model.fp32_head) against fp32, beside
                   the bf16 head's error, and what the float32 head costs in a log-prob pass's time
    sdpa           SDPA against eager attention under left padding, fp32 and bf16
    memory         peak allocated and reserved memory of a micro-batch's forward and backward (bf16,
                   gradient checkpointing, the chunked head) against completion length
    generate       sampling tokens/s and the rollout's share of a step (generate, then the step's training)
    mfu            the training step's model FLOPs (worker/algos/flops.py) over its time, against a matmul
                   peak measured here and, on a known card, the datasheet's dense bf16 peak

Ends with the table in Markdown, and `--json PATH` writes the rows.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, without installing it

from worker.algos import flops  # noqa: E402
from worker.algos.logprobs import Float32Head  # noqa: E402
from worker.algos.losses import Normaliser, sample_losses  # noqa: E402
from worker.batch import RolloutBatch  # noqa: E402
from worker.machine.hardware import decoder_shape, peak_flops  # noqa: E402
from worker.model.forward import sequence_logprobs  # noqa: E402

# Config fields of the real models (their config.json): the same layers, widths, heads and vocabulary.
SHAPES = {
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                                   tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                   tie_word_embeddings=True)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048,
                           tie_word_embeddings=True)),
}
# Dense bf16 tensor-core peaks from the vendors' datasheets (FLOP/s), by a substring of the device name.
# Dense bf16 tensor-core peaks from the vendors' datasheets (FLOP/s): the first entry whose name is in the
# device's name (an "H100 80GB HBM3" is the SXM card; "L40S" before "L4").
DATASHEET_BF16 = [("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
                  ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 70e12)]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Bounds each row is held to (the verdict column): fp32 on two devices sums in other orders; bf16 has an
# 8-bit mantissa (measured on SmolLM2-135M's real weights on a CPU: error up to 0.24, drift up to 0.22).
AGREEMENT_NATS, BF16_NATS, SDPA_FP32_NATS = 1e-3, 0.5, 1e-4


@dataclass
class Row:
    check: str
    model: str
    measured: str
    bound: str = ""
    verdict: str = ""  # ok | over | "" (a measurement, no bound)


@functools.cache
def _initialised(shape: str) -> torch.nn.Module:
    """A randomly initialised decoder of `shape` in fp32 on the CPU with a LoRA adapter (r 16) whose B is
    nonzero, so the adapter changes the log-probs the way a trained one does; made once per shape (a
    0.5B model's initialisation takes seconds), then copied."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, fields = SHAPES[shape]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **fields), attn_implementation="sdpa",
                                             dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return model


def build(shape: str, dtype: torch.dtype, device: str, *, attn: str = "sdpa") -> torch.nn.Module:
    """The shape's one set of weights, in `dtype` on `device`, with `attn` attention: every model of a
    shape holds the same weights, so two of them differ only by what the check varies."""
    model = copy.deepcopy(_initialised(shape))
    if attn != "sdpa":
        model.get_base_model().set_attn_implementation(attn)
    return model.to(device=device, dtype=dtype).eval()


def batch(rows: int, prompt: int, completion: int, vocab: int, *, seed: int = 0) -> RolloutBatch:
    """Random tokens with the shape of a GRPO batch: prompts of different lengths (left padding) and
    completions of different lengths (right padding)."""
    gen = torch.Generator().manual_seed(seed)
    p_len = [max(1, prompt - (i * prompt) // (2 * rows)) for i in range(rows)]
    c_len = [max(1, completion - (i * completion) // (3 * rows)) for i in range(rows)]
    ids = lambda n: torch.randint(3, vocab, (n,), generator=gen)  # noqa: E731
    pm = torch.tensor([[0] * (prompt - n) + [1] * n for n in p_len])
    cm = torch.tensor([[1] * n + [0] * (completion - n) for n in c_len])
    return RolloutBatch(prompt_ids=torch.stack([ids(prompt) for _ in range(rows)]) * pm, prompt_mask=pm,
                        completion_ids=torch.stack([ids(completion) for _ in range(rows)]) * cm, completion_mask=cm,
                        truncated=torch.zeros(rows, dtype=torch.bool), completions=[""] * rows)


def logprobs(model: torch.nn.Module, b: RolloutBatch, device: str) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logprobs(model, b.to(device), 1.0)[0].double().cpu()


def grpo_step(model: torch.nn.Module, b: RolloutBatch, device: str, lr: float = 1e-3) -> float:
    """One GRPO update as the loop makes it: old log-probs from this forward (ratio 1), group-normalised
    advantages of fixed rewards, the clipped surrogate with token_mean, AdamW on the adapter. The loss."""
    b = b.to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    rewards = torch.arange(len(b), dtype=torch.float32, device=device) % 3
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    logp, _ = sequence_logprobs(model, b, 1.0)
    mask = b.completion_mask.to(logp.dtype)
    parts = sample_losses(logp, logp.detach(), adv, mask, Normaliser.of(mask, "token_mean"))
    loss = parts.loss.sum()
    loss.backward()
    opt.step()
    model.eval()
    return loss.item()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def verdict(value: float, bound: float) -> str:
    return "ok" if value <= bound else "over"


def check_agreement(shape: str, device: str, b: RolloutBatch) -> list[Row]:
    here, ref = build(shape, torch.float32, device), build(shape, torch.float32, "cpu")
    before = (logprobs(here, b, device) - logprobs(ref, b, "cpu")).abs().max().item()
    loss_here, loss_ref = grpo_step(here, b, device), grpo_step(ref, b, "cpu")
    after = (logprobs(here, b, device) - logprobs(ref, b, "cpu")).abs().max().item()
    worst = max(before, after)
    return [Row("agreement", shape, f"log-probs max |Δ| {before:.1e} before, {after:.1e} after the step; "
                f"loss {loss_here:.6f} vs {loss_ref:.6f}", f"≤ {AGREEMENT_NATS:g} nats", verdict(worst, AGREEMENT_NATS))]


def check_bf16(shape: str, device: str, b: RolloutBatch) -> list[Row]:
    f32, bf = build(shape, torch.float32, device), build(shape, torch.bfloat16, device)
    lp32, lp16 = logprobs(f32, b, device), logprobs(bf, b, device)
    real = b.completion_mask.bool()
    err = (lp16 - lp32)[real].abs()
    alone = [logprobs(bf, b.select([i]), device)[0] for i in range(len(b))]
    drift = max((a - t)[m].abs().max().item() for a, t, m in zip(alone, lp16, real))
    # the loop's rule: old log-probs are the first epoch's own forward, so its ratio is exp(0)
    lp = sequence_logprobs(bf, b.to(device), 1.0)[0]
    ratio = torch.exp(lp - lp.detach())[b.completion_mask.bool().to(device)]
    ratio_dev = (ratio.double() - 1).abs().max().item()
    return [Row("bf16", shape, f"vs fp32: max {err.max().item():.3f}, mean {err.mean().item():.4f} nats; a row alone vs "
                f"batched: max {drift:.3f} nats", f"≤ {BF16_NATS:g} nats", verdict(max(err.max().item(), drift), BF16_NATS)),
            Row("ratio", shape, f"first epoch, bf16: max |r − 1| = {ratio_dev:.1e}", "= 0", "ok" if ratio_dev == 0 else "over")]


def check_fp32_head(shape: str, device: str, b: RolloutBatch) -> list[Row]:
    f32, bf, head32 = (build(shape, dtype, device) for dtype in (torch.float32, torch.bfloat16, torch.bfloat16))
    head32.set_output_embeddings(Float32Head.wrap(head32.get_output_embeddings()))
    real = b.completion_mask.bool()
    lp32 = logprobs(f32, b, device)
    err16, err = ((logprobs(m, b, device) - lp32)[real].abs() for m in (bf, head32))

    def seconds(model: torch.nn.Module) -> float:
        runs = []
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            logprobs(model, b, device)
            sync(device)
            runs.append(time.perf_counter() - t0)
        return sorted(runs)[1]

    cost = seconds(head32) / seconds(bf)
    return [Row("fp32 head", shape, f"vs fp32: max {err.max().item():.3f}, mean {err.mean().item():.4f} nats (bf16 head: "
                f"mean {err16.mean().item():.4f}); log-prob pass {cost:.2f}x the bf16 head's time",
                f"≤ {BF16_NATS:g} nats", verdict(err.max().item(), BF16_NATS))]


def check_sdpa(shape: str, device: str, b: RolloutBatch) -> list[Row]:
    out = []
    for dtype, bound in ((torch.float32, SDPA_FP32_NATS), (torch.bfloat16, BF16_NATS)):
        sdpa, eager = build(shape, dtype, device, attn="sdpa"), build(shape, dtype, device, attn="eager")
        d = (logprobs(sdpa, b, device) - logprobs(eager, b, device))[b.completion_mask.bool()].abs().max().item()
        name = str(dtype).removeprefix("torch.")
        out.append(Row(f"sdpa {name}", shape, f"SDPA vs eager, left-padded batch: max |Δ| {d:.1e} nats",
                       f"≤ {bound:g} nats", verdict(d, bound)))
    return out


def check_memory(shape: str, device: str, lengths: list[int], rows: int) -> list[Row]:
    """A micro-batch of `rows` rows (prompt 64) at each completion length: forward and backward in bf16 with
    gradient checkpointing and the chunked head."""
    model = build(shape, torch.bfloat16, device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = SHAPES[shape][1]["vocab_size"]
    cells = []
    for T in lengths:
        b = batch(rows, 64, T, vocab, seed=T)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            model.train()
            logp, _ = sequence_logprobs(model, b.to(device), 1.0)
            (logp * b.completion_mask.to(device)).sum().backward()
            sync(device)
        except torch.OutOfMemoryError:
            cells.append(f"{T}: OOM")
            break
        finally:
            model.zero_grad(set_to_none=True)
        s = time.perf_counter() - t0
        if device.startswith("cuda"):
            cells.append(f"{T}: {torch.cuda.max_memory_allocated() / 2**30:.2f}/"
                         f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB, {s:.2f} s")
        else:
            cells.append(f"{T}: {s:.2f} s")
    what = "allocated/reserved peak, time" if device.startswith("cuda") else "time (no device memory counter)"
    return [Row("memory", shape, f"{rows} rows × completion length, {what}: " + "; ".join(cells))]


def check_generate_and_mfu(shape: str, device: str, rows: int, prompt: int, completion: int) -> list[Row]:
    """Sampling `rows` completions of `completion` tokens, then the step's training on what was sampled
    (bf16 on an accelerator, fp32 on a CPU), as a step of the loop does them one after the other."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = build(shape, dtype, device)
    vocab = SHAPES[shape][1]["vocab_size"]
    b = batch(rows, prompt, completion, vocab)
    kw = dict(max_new_tokens=completion, min_new_tokens=completion, do_sample=True, top_k=0, pad_token_id=0)
    with torch.no_grad():  # a warm-up: the first call pays for kernels and caches
        model.generate(input_ids=b.prompt_ids.to(device), attention_mask=b.prompt_mask.to(device), **{**kw,
                       "max_new_tokens": 2, "min_new_tokens": 2})
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=b.prompt_ids.to(device), attention_mask=b.prompt_mask.to(device), **kw)
        sync(device)
        gen_s = time.perf_counter() - t0
    sampled = RolloutBatch(prompt_ids=b.prompt_ids, prompt_mask=b.prompt_mask,
                           completion_ids=out[:, b.prompt_ids.shape[1]:].cpu(),
                           completion_mask=torch.ones(rows, completion, dtype=torch.long),
                           truncated=torch.ones(rows, dtype=torch.bool), completions=[""] * rows)
    grpo_step(model, sampled, device)  # a warm-up of the training kernels
    sync(device)
    t0 = time.perf_counter()
    grpo_step(model, sampled, device)
    sync(device)
    train_s = time.perf_counter() - t0
    dshape = decoder_shape(model)
    prompts = [int(x) for x in b.prompt_mask.sum(1)]
    work = flops.training(sum(flops.forward(dshape, p, completion) for p in prompts), frozen_base=True) \
        if dshape else 0
    needed = flops.sampling(dshape, prompts, [[completion] for _ in prompts]) if dshape else 0
    peak = peak_flops(torch.device(device), dtype)
    rows_out = [Row("generate", shape, f"{rows * completion / gen_s:,.0f} tokens/s ({rows} rows × {completion}); "
                    f"rollout {gen_s:.2f} s of a {gen_s + train_s:.2f} s step ({gen_s / (gen_s + train_s):.0%})")]
    mfu = f"train {work / train_s / 1e12:.3g} TFLOP/s = {work / train_s / peak:.1%} of a measured " \
          f"{peak / 1e12:.3g} TFLOP/s {str(dtype).removeprefix('torch.')} matmul; sampling {needed / gen_s / peak:.1%}"
    name = torch.cuda.get_device_name() if device.startswith("cuda") else ""
    sheet = next((v for k, v in DATASHEET_BF16 if k in name), None)
    if sheet and dtype == torch.bfloat16:
        mfu += f"; {work / train_s / sheet:.1%} of the datasheet's {sheet / 1e12:.0f} TFLOP/s"
    return rows_out + [Row("mfu", shape, mfu)]


def machine(device: str) -> str:
    what = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    if device.startswith("cuda"):
        what = f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    import transformers
    return (f"{what}; torch {torch.__version__}, transformers {transformers.__version__}"
            + (f"; commit {commit}" if commit else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--short", action="store_true", help="tiny shapes and lengths: seconds on a CPU (CI)")
    ap.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} (default: tiny with --short, "
                    "else the two real shapes)")
    ap.add_argument("--lengths", help="completion lengths of the memory row, comma-separated")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    device = args.device
    shapes = args.shapes.split(",") if args.shapes else ["tiny"] if args.short else ["smollm2-135m", "qwen2.5-0.5b"]
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else \
        [32, 64] if args.short else [256, 512, 1024, 2048, 4096]
    rows: list[Row] = []
    t0 = time.perf_counter()
    for shape in shapes:
        vocab = SHAPES[shape][1]["vocab_size"]
        b = batch(4, 24 if args.short else 96, 16 if args.short else 128, vocab)
        if device == "cpu":
            rows.append(Row("agreement", shape, "no accelerator: the CPU is the reference"))
        for check in ((check_agreement, check_bf16, check_fp32_head, check_sdpa) if device != "cpu"
                      else (check_bf16, check_fp32_head, check_sdpa)):
            rows += check(shape, device, b)
            print(f"[{time.perf_counter() - t0:.0f} s] {shape}: {rows[-1].check}", file=sys.stderr, flush=True)
        rows += check_memory(shape, device, lengths, 4 if args.short else 8)
        rows += check_generate_and_mfu(shape, device, 8 if args.short else 64, 16 if args.short else 64,
                                       8 if args.short else 128)
        print(f"[{time.perf_counter() - t0:.0f} s] {shape}: done", file=sys.stderr, flush=True)
    print(f"\n{machine(device)}; {time.perf_counter() - t0:.0f} s\n")
    print("| check | model | measured | bound | verdict |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        cells = (r.check, r.model, r.measured, r.bound, r.verdict)
        print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    over = [r for r in rows if r.verdict == "over"]
    print(f"\nRESULT rows={len(rows)} over_bound={len(over)}")
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
