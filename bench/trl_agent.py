"""TRL's side of bench/trl_agents.py: TRL's `GRPOTrainer(environment_factory=...)` training our cold-started
model in our bundled `multiplication` environment. Runs in TRL's own environment (`make trl`), never imported
by the service:

    .venv-trl/bin/python bench/trl_agent.py --task task.json --out trl.json

The task file (written by the harness) names the base model folder, the SFT checkpoint (a peft adapter
folder with the tokenizer and its `chatml-tools` template, as `grpo-jobs download` unpacks it), the URL of
a bundled environment server the harness started, the reset seeds to train on and the matched settings.
Each rollout is one session on that server over OpenEnv's WebSocket protocol: TRL's `reset` resets it to a
seed (the task is the observation), the environment's `calculator` method is the server's MCP tool (a
`tools/call`), and the reward is what the server pays the model's last turn, sent as a text step: the
same tool, tasks and reward as our jobs. TRL parses tool calls with Qwen's response template: `chatml-tools`
writes Qwen2.5's `<tool_call>` format. Writes one JSON: each step's mean reward and the versions.
"""

from __future__ import annotations

import json
import tempfile

import torch
from datasets import Dataset
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_template
from trl_grpo import read_task  # bench/ is on the path when a bench runs
from websockets.sync.client import connect

URL = ""  # the environment server's base URL, set from the task file before the trainer builds its pool


class Multiplication:
    """One rollout's session on our bundled `multiplication` server."""

    def __init__(self) -> None:
        self.ws = connect(URL.replace("http://", "ws://") + "/ws", max_size=2**22)
        self.rpc_id = 0

    def _ask(self, message: dict) -> dict:
        self.ws.send(json.dumps(message))
        answer = json.loads(self.ws.recv(timeout=60))
        if answer.get("type") == "error":
            raise RuntimeError(f"the environment answered {message['type']} with {answer.get('data')}")
        return answer["data"]

    def reset(self, seed: int, **_) -> str:
        """A new episode on task `seed`; its task, which TRL appends to the user's (empty) message."""
        return self._ask({"type": "reset", "data": {"seed": seed}})["observation"]["message"]

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression: numbers, + - * / // and parentheses. Returns the result.

        Args:
            expression: The expression to evaluate, for example 1234*56.
        """
        self.rpc_id += 1
        data = self._ask({"type": "mcp", "data": {"jsonrpc": "2.0", "id": self.rpc_id, "method": "tools/call",
                                                   "params": {"name": "calculator", "arguments": {"expression": expression}}}})
        if "error" in data:  # raised: TRL hands the model {"error": ...}, as our episodes hand it the tool's error
            raise ValueError(str(data["error"].get("message", data["error"])))
        result = data["result"]
        text = "\n".join(c.get("text", "") for c in result.get("content", []) if c.get("type") == "text")
        if result.get("isError"):
            raise ValueError(text)
        return text

    def _answer(self, text: str) -> float:
        """The server's reward for the model's last turn, sent as a text step (0 if it paid none); private, as
        TRL offers every public method to the model as a tool."""
        return float(self._ask({"type": "step", "data": {"message": text}}).get("reward") or 0.0)


def paid(completions, environments, **_) -> list[float]:
    """Each rollout's reward: the environment's, for its last assistant turn (none after a tool's answer)."""
    rewards = []
    for messages, env in zip(completions, environments, strict=True):
        last = messages[-1] if messages else {}
        rewards.append(env._answer(last.get("content") or "") if last.get("role") == "assistant" else 0.0)
    return rewards


def main() -> None:
    global URL
    task, out_file = read_task()
    m = task["matched"]
    URL = task["url"]

    torch.manual_seed(task["seed"])
    tokenizer = AutoTokenizer.from_pretrained(task["adapter_dir"], padding_side="left")
    tokenizer.response_template = qwen3_template  # TRL knows Qwen's templates by their text, not chatml-tools
    base = AutoModelForCausalLM.from_pretrained(task["model_dir"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, task["adapter_dir"], is_trainable=True)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": ""}], "seed": s} for s in task["seeds"]])
    rows = m["prompts_per_step"] * m["num_generations"]
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, seed=task["seed"], max_steps=m["steps"], use_cpu=True, bf16=False,
            per_device_train_batch_size=m["micro_batch_size"], gradient_accumulation_steps=rows // m["micro_batch_size"],
            num_generations=m["num_generations"], max_completion_length=m["max_completion_length"],
            max_tool_calling_iterations=m["max_turns"] - 1, temperature=m["temperature"],
            learning_rate=m["learning_rate"], beta=m["kl_coef"], epsilon=m["clip_eps"], max_grad_norm=m["max_grad_norm"],
            lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=paid, args=config, train_dataset=data,
                              processing_class=tokenizer, environment_factory=Multiplication)
        trainer.train()
        logged = [h for h in trainer.state.log_history if "reward" in h]
    out_file.write_text(json.dumps({
        "reward": [h["reward"] for h in logged],
        "tool_calls": [h.get("tools/call_frequency", float("nan")) for h in logged],
        "logged": logged,
        "versions": {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
                     "torch": torch.__version__},
    }))


if __name__ == "__main__":
    main()
