"""tinker-cookbook's RL loop (`tinker_cookbook.rl.train`), unmodified, on its arithmetic environment
(`recipes/math_rl/arithmetic_env.py`: "What is x + y?", graded answers), configured for this server:
base URL, the bundled SmolLM2, small batches and few steps. Run in the cookbook's own environment
(`make cookbook`):

    TINKER_BASE_URL=... TINKER_API_KEY=... HF_HOME=<a cache holding SmolLM2's tokenizer> \\
        .venv-cookbook/bin/python tests/cookbook/rl_arithmetic.py LOG_DIR STEPS

RL_BATCH (problems a step, 8), RL_GROUP (answers a problem, 4), RL_MAX_TOKENS (8) and RL_LR (1e-3)
change the defaults, which are the suite's.

The renderer is `qwen3_instruct`: its ChatML turns are the ones SmolLM2-Instruct was tuned on, and it
stops at `<|im_end|>`. With `role_colon` the model rarely ends its answer with the renderer's
"\\n\\nUser:", so nearly every group has one reward and nothing to learn from.
"""

import asyncio
import os
import sys

from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RENDERER = "qwen3_instruct"


def main(log_path: str, steps: int) -> None:
    env = os.environ.get
    dataset = ArithmeticDatasetBuilder(batch_size=int(env("RL_BATCH", 8)), group_size=int(env("RL_GROUP", 4)),
                                       model_name_for_tokenizer=MODEL, renderer_name=RENDERER, n_batches=steps)
    config = train.Config(learning_rate=float(env("RL_LR", 1e-3)), dataset_builder=dataset, model_name=MODEL,
                          recipe_name="rl_arithmetic", max_tokens=int(env("RL_MAX_TOKENS", 8)), log_path=log_path,
                          renderer_name=RENDERER, eval_every=0, save_every=0, loss_fn="importance_sampling",
                          lora_rank=16, base_url=os.environ["TINKER_BASE_URL"], max_steps=steps)
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
