"""tinker-cookbook's RL loop (`tinker_cookbook.rl.train`), unmodified, on its arithmetic environment
(`recipes/math_rl/arithmetic_env.py`: "What is x + y?", graded answers), configured for this server:
base URL, the bundled SmolLM2, small batches and few steps. Run in the cookbook's own environment
(`make cookbook`):

    TINKER_BASE_URL=... TINKER_API_KEY=... HF_HOME=<a cache holding SmolLM2's tokenizer> \\
        .venv-cookbook/bin/python tests/cookbook/rl_arithmetic.py LOG_DIR STEPS
"""

import asyncio
import os
import sys

from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RENDERER = os.environ.get("RL_RENDERER", "qwen3_instruct")  # ChatML, the format SmolLM2-Instruct was tuned on


def main(log_path: str, steps: int) -> None:
    env = os.environ.get
    dataset = ArithmeticDatasetBuilder(batch_size=int(env("RL_BATCH", 8)), group_size=int(env("RL_GROUP", 8)),
                                       model_name_for_tokenizer=MODEL, renderer_name=RENDERER, n_batches=steps)
    config = train.Config(learning_rate=float(env("RL_LR", 2e-4)), dataset_builder=dataset, model_name=MODEL,
                          recipe_name="rl_arithmetic", max_tokens=int(env("RL_MAX_TOKENS", 8)), log_path=log_path, renderer_name=RENDERER, eval_every=0, save_every=0,
                          loss_fn="importance_sampling", lora_rank=16, base_url=os.environ["TINKER_BASE_URL"],
                          max_steps=steps)
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
