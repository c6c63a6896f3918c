"""Demonstrations for a cold start (`dataset: env-demos`): the job's bundled tool environment played by a
scripted solver that calls its tools as a model would, the correct episodes kept as training rows.

The solver is a rollout engine whose turns are written, not sampled: on a task it calls the `calculator`
tool on the task's expression (`<tool_call>{"name": "calculator", "arguments": {"expression": ...}}
</tool_call>`), and once the tool has answered, it answers with the result (`<answer>N</answer>`). Its
episodes are played like any job's (the same chat template, tools block and tool messages, the same
token contract), so a demonstration's ids are exactly the ids an episode of the model would have, and
its trained tokens are the model's turns only. Only episodes the environment rewarded as solved are kept.

Demonstrations come from reset seeds of their own (DEMO_SEEDS on): neither a training step's draws
(below EVAL_SEEDS) nor evaluation's (EVAL_SEEDS on) can meet one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from service.core.settings import Settings
from service.core.specs import SFTJob
from worker.batch import RolloutBatch, left_padded
from worker.datasets import Example, TaskData
from worker.environments.acting import declared
from worker.environments.continuous import Continuous
from worker.environments.episodes import Episode, transcript
from worker.environments.host import EVAL_SEEDS, limits_of, tool_use
from worker.environments.runner import Players, play
from worker.environments.servers import BundledServer
from worker.environments.turns import turn_format

DEMO_SEEDS = EVAL_SEEDS + 2**30
SOLVED = 1.0  # an episode's reward at or above this solved its task (right answer)
_PRODUCT = re.compile(r"What is (\d+) \* (\d+)\?")
_WORDS = re.compile(r"has (\d+) \w+ and (gets|gives away) (\d+)")
_RESULT = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


def expression(task: str) -> str | None:
    """The arithmetic a bundled task asks for, as the calculator reads it."""
    if (m := _PRODUCT.search(task)) is not None:
        return f"{m.group(1)}*{m.group(2)}"
    if (m := _WORDS.search(task)) is not None:
        return f"{m.group(1)}{'+' if m.group(2) == 'gets' else '-'}{m.group(3)}"
    return None


def solver_turn(context: str) -> str:
    """The solver's next turn, from the conversation so far: a tool call, or the tool's result as the answer."""
    results = _RESULT.findall(context)
    if results and results[-1].strip().lstrip("-").isdigit():
        return f"<answer>{results[-1].strip()}</answer>"
    expr = expression(context)
    call = {"name": "calculator", "arguments": {"expression": expr or "0"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def written(tokenizer, prompts: list[list[int]], texts: list[str]) -> RolloutBatch:
    """The batch an engine returns had it sampled `texts` (one per prompt, each ended with EOS): what a
    scripted engine hands the episode runner."""
    done = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
    prompt_ids, prompt_mask = left_padded([list(p) for p in prompts], tokenizer.pad_token_id)
    T = max(len(d) for d in done)
    ids = torch.tensor([d + [tokenizer.pad_token_id] * (T - len(d)) for d in done], dtype=torch.long)
    mask = torch.tensor([[1] * len(d) + [0] * (T - len(d)) for d in done], dtype=torch.long)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=ids, completion_mask=mask,
                        truncated=torch.zeros(len(done), dtype=torch.bool), completions=list(texts))


class Solver:
    """A rollout engine whose turns are solver_turn's, each ended with the tokenizer's EOS."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def generate(self, prompts, n, *, seeds=None, greedy=False) -> RolloutBatch:
        rows = [list(p) for p in prompts for _ in range(n)]
        return written(self.tok, rows, [solver_turn(self.tok.decode(p)) for p in rows])


def demonstrations(spec: SFTJob, settings: Settings, tokenizer, log_dir: Path) -> TaskData:
    """`dataset.num_train` training and `num_val` validation demonstrations of the job's environment, each
    an Example whose `meta["episode"]` holds its ids. ValueError when the solver solves too few (an
    environment it does not know)."""
    env, d = spec.environment, spec.dataset
    assert env is not None and env.name is not None
    server = BundledServer(env.name, log_dir / f"demos-{env.name}.log")
    try:
        url = server.start()
        use = tool_use(env, url, settings)
        players = Players(engine=Solver(tokenizer), tokenizer=tokenizer,  # type: ignore[arg-type]
                          turns=turn_format(tokenizer, chat=True, tools=declared(use.tools)),
                          eos_ids=frozenset({tokenizer.eos_token_id}), max_new_tokens=spec.sft.max_new_tokens,
                          tools=use)
        seeds = [DEMO_SEEDS + d.seed * 1_000_003 + i for i in range(d.num_train + d.num_val)]
        episodes, _ = play(players, url, seeds, 1, limits_of(env, settings), seed_of=None, scheduler=Continuous())
    finally:
        server.stop()
    solved = [e for e in episodes if e.reward(env.reward) >= SOLVED]
    if len(solved) < len(episodes) * 0.9:
        raise ValueError(f"dataset env-demos: the solver solved {len(solved)} of {len(episodes)} {env.name} tasks")
    rows = [_example(e) for e in solved]
    n_val = min(d.num_val, len(rows) // 2)
    return TaskData(train=rows[: len(rows) - n_val], val=rows[len(rows) - n_val:], instruction="")


def _example(e: Episode) -> Example:
    return Example(question=e.first_observation, answers=(transcript(e),), meta={"episode": e, "seed": e.seed})
