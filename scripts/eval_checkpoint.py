"""Evaluate a downloaded checkpoint outside the service, with plain transformers and peft.

    grpo-jobs download JOB --out ckpt/
    python scripts/eval_checkpoint.py --checkpoint ckpt/job-7-step-10 --base path/to/base-model \\
        --data eval.jsonl --max-new-tokens 64 --reward exact_match

Greedy decoding, one completion per row, in batches like the service's evaluation, so the
numbers match the job's final `eval/*` metrics. Prints JSON: accuracy, reward_mean, completions.
`--base` is a local model folder (or a tiny preset); an adapter's own config names the public base.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from service.core.datafiles import read_rows, sniff, task_row  # noqa: E402
from worker import rewards  # noqa: E402
from worker.datasets import render_prompt  # noqa: E402
from worker.engines.hf_engine import eos_token_ids  # noqa: E402
from worker.model.loading import TINY_PRESETS, tiny_model  # noqa: E402


def load(checkpoint: Path, base: str):
    tok = AutoTokenizer.from_pretrained(checkpoint)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not (checkpoint / "adapter_config.json").exists():  # a full fine-tune: the folder is the model
        return AutoModelForCausalLM.from_pretrained(checkpoint).eval(), tok
    from peft import PeftModel

    model = tiny_model(base, len(tok)) if base in TINY_PRESETS else AutoModelForCausalLM.from_pretrained(base)
    return PeftModel.from_pretrained(model, checkpoint).eval(), tok


@torch.no_grad()
def greedy(model, tok, prompts: list[str], *, max_new_tokens: int, batch: int) -> list[str]:
    eos = sorted(eos_token_ids(tok, model))  # where the service's rollouts end a completion
    out = []
    for i in range(0, len(prompts), batch):
        enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                             top_k=None, pad_token_id=tok.pad_token_id, eos_token_id=eos)
        for row in ids[:, enc["input_ids"].shape[1]:].tolist():
            n = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            out.append(tok.decode(row[:n], skip_special_tokens=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="an unpacked checkpoint folder")
    ap.add_argument("--base", default="", help="base model folder (LoRA checkpoints), or a tiny preset")
    ap.add_argument("--data", type=Path, required=True, help="eval rows {prompt, answer|answers}, JSONL or Parquet")
    ap.add_argument("--limit", type=int, default=32, help="rows evaluated (the job's grpo.eval_prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="the job's 2 * grpo.micro_batch_size")
    ap.add_argument("--reward", default="exact_match",
                    help="the job's reward, for its eval/reward_mean: a built-in name, or module:function")
    ap.add_argument("--system-prompt", default="", help="the job's dataset.system_prompt, if it set one")
    ap.add_argument("--accuracy", default="exact_match", choices=("exact_match", "numeric_match"),
                    help="the job's dataset.accuracy")
    args = ap.parse_args()
    model, tok = load(args.checkpoint, args.base)
    rows = [task_row(r) for _, r in read_rows(args.data, sniff(args.data))][: args.limit]
    prompts = [render_prompt(tok, r.question, args.system_prompt) for r in rows]
    completions = greedy(model, tok, prompts, max_new_tokens=args.max_new_tokens, batch=args.batch)
    if ":" in args.reward:  # a plugin's function, as the service's entry points name them
        module, _, fn = args.reward.partition(":")
        reward = getattr(importlib.import_module(module), fn)
    else:
        reward = rewards.REGISTRY[args.reward].fn
    print(json.dumps({
        "accuracy": sum(rewards.REGISTRY[args.accuracy].fn(c, r.answers) for c, r in zip(completions, rows)) / len(rows),
        "reward_mean": sum(reward(c, r.answers) for c, r in zip(completions, rows)) / len(rows),
        "completions": completions}))


if __name__ == "__main__":
    main()
