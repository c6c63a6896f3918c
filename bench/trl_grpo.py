"""TRL's side of bench/trl_side_by_side.py: TRL's GRPOTrainer on the prompts and answers that the harness
wrote, timed step by step. Runs in TRL's own environment (`make trl`), never imported by the service:

    .venv-trl/bin/python bench/trl_grpo.py --task task.json --out trl.json

The task file (written by the harness, from our dataset and chat template) holds the model folder, the
rendered prompts with their answers, the matched settings, and TRL's own precision settings (`trl`: the
model's load dtype, `bf16` autocast, gradient checkpointing). The reward is our own `numeric_match`, read
from the checkout's worker/rewards/functions.py, so both sides score with one definition. Writes one JSON:
each optimizer step's wall time (TRL samples inside the step, so it holds rollout and training), the
steps' mean reward, and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]


def our_reward_functions():
    """worker/rewards/functions.py loaded on its own: the worker package's other modules need the
    service's dependencies, which this environment does not hold."""
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("grpo_reward_functions", ROOT / "worker" / "rewards" / "functions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


class StepClock(TrainerCallback):
    """Wall time of each optimizer step, from its first micro-batch (where TRL samples) to the update."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_s.append(time.perf_counter() - self._t0)


def read_task() -> tuple[dict, Path]:
    """The harness's task file (`--task`), and where the result goes (`--out`)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    return json.loads(args.task.read_text()), args.out


def main() -> None:
    task, out_file = read_task()
    m = task["matched"]
    numeric_match = our_reward_functions().numeric_match

    def reward(completions, answers, **_):
        return [numeric_match(c, a) for c, a in zip(completions, answers, strict=True)]

    torch.manual_seed(task["seed"])
    tokenizer = AutoTokenizer.from_pretrained(task["model_dir"])
    how = task.get("trl", {"dtype": "float32", "bf16": False, "gradient_checkpointing": False})
    model = AutoModelForCausalLM.from_pretrained(task["model_dir"], dtype=getattr(torch, how["dtype"]))
    data = Dataset.from_list([{"prompt": p, "answers": a} for p, a in zip(task["prompts"], task["answers"], strict=True)])
    micro = m["micro_batch_size"]
    rows = m["prompts_per_step"] * m["num_generations"]
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, seed=task["seed"], max_steps=m["steps"], use_cpu=True,
            bf16=how["bf16"], gradient_checkpointing=how["gradient_checkpointing"],  # the harness's TRL setting
            per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,  # one generation batch per step
            num_generations=m["num_generations"], max_completion_length=m["max_new_tokens"],
            temperature=m["temperature"], learning_rate=m["learning_rate"], beta=m["kl_coef"],
            epsilon=m["clip_eps"], max_grad_norm=m["max_grad_norm"], lr_scheduler_type="constant",
            logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
        )
        lora = LoraConfig(r=m["lora_r"], lora_alpha=m["lora_alpha"], target_modules="all-linear", task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                              processing_class=tokenizer, peft_config=lora, callbacks=[clock])
        trainer.train()
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    out_file.write_text(json.dumps({
        "step_s": clock.step_s, "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "versions": {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
                     "torch": torch.__version__},
    }))


if __name__ == "__main__":
    main()
