"""tinker-cookbook's supervised loop (`tinker_cookbook.supervised.train`), unmodified, on its own
`example_data/conversations.jsonl`, configured for this server: base URL, the bundled SmolLM2, a small
batch and few steps. Run in the cookbook's own environment (`make cookbook`):

    TINKER_BASE_URL=... TINKER_API_KEY=... HF_HOME=<a cache holding SmolLM2's tokenizer> \\
        .venv-cookbook/bin/python tests/cookbook/sl_conversations.py LOG_DIR STEPS

SL_SAVE_EVERY=N saves the state every N steps (0, the default: at the end only). Run again with the
same LOG_DIR, the loop resumes from its last saved state.
"""

import asyncio
import os
import sys
from pathlib import Path

import tinker_cookbook
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RENDERER = "role_colon"  # plain "User: ... Assistant: ..." turns: the cookbook has no SmolLM2 renderer


def main(log_path: str, steps: int) -> None:
    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=MODEL, renderer_name=RENDERER, max_length=256,
                                            batch_size=8, train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    config = train.Config(log_path=log_path, model_name=MODEL, renderer_name=RENDERER, recipe_name="sl_conversations",
                          dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data)),
                          learning_rate=5e-4, lr_schedule="constant", num_epochs=4, lora_rank=16,
                          base_url=os.environ["TINKER_BASE_URL"],
                          save_every=int(os.environ.get("SL_SAVE_EVERY", 0)), eval_every=0, max_steps=steps)
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
