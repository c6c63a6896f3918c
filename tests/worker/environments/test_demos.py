"""Demonstrations for a cold start: the solver's traces of the bundled multiplication environment, played
with SmolLM2's tokenizer and the ChatML tools template. Every trace solves its task when its turns are
played again against the environment, and replaying them gives exactly its ids: a demonstration is
tokenized as the model's own episodes are."""

import pytest

from service.core.settings import Settings
from service.core.specs import SFTJob
from worker.environments.acting import declared
from worker.environments.continuous import Continuous
from worker.environments.demos import DEMO_SEEDS, demonstrations, expression, solver_turn, written
from worker.environments.episodes import rows
from worker.environments.host import tool_use
from worker.environments.limits import Limits
from worker.environments.runner import Players, play
from worker.environments.servers import BundledServer
from worker.environments.turns import turn_format
from worker.model.loading import load_tokenizer


def test_the_solver_reads_the_task_and_answers_with_the_tools_result():
    assert expression("What is 3998 * 618?\nUse the calculator") == "3998*618"
    assert expression("Ada has 17 coins and gives away 4. How many") == "17-4"
    assert expression("Ben has 12 books and gets 9 more.") == "12+9"
    first = solver_turn("<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n")
    assert first == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    assert solver_turn("What is 12 * 34? ... <tool_response>\n408\n</tool_response>") == "<answer>408</answer>"


class Replay:
    """An engine that writes, turn by turn, the texts a demonstration's turns wrote."""

    def __init__(self, tok, turns_of: dict[str, list[str]]):
        self.tok, self.turns_of = tok, turns_of

    def generate(self, prompts, n, *, seeds=None, greedy=False):
        texts = []
        for p in prompts:
            context = self.tok.decode(p)
            task = next(t for t in self.turns_of if t in context)
            texts.append(self.turns_of[task][context.count("<|im_start|>assistant") - 1])
        return written(self.tok, prompts, texts)


def test_every_demonstration_solves_its_task_replayed_and_is_tokenized_as_an_episode(models_root, tmp_path):
    spec = SFTJob.model_validate({
        "kind": "sft", "model": {"name": "smollm2-135m-instruct", "chat_template": "chatml-tools"},
        "dataset": {"name": "env-demos", "num_train": 6, "num_val": 2},
        "environment": {"name": "multiplication", "tools": "mcp", "max_turns": 3, "max_episode_tokens": 400}})
    tok = load_tokenizer(spec.model, models_root=models_root)
    task = demonstrations(spec, Settings(), tok, tmp_path)
    demos = task.train + task.val
    assert (len(task.train), len(task.val)) == (6, 2)
    assert all(ex.meta["seed"] >= DEMO_SEEDS for ex in demos)  # no training step's or evaluation's seed
    batch = rows([ex.meta["episode"] for ex in demos], tok.pad_token_id)
    for i in range(len(demos)):  # the model's turns are trained; the tool's answers are context
        trained = tok.decode(batch.completion_ids[i][batch.loss_mask()[i].bool()])
        assert "<tool_call>" in trained and "<answer>" in trained and "<tool_response>" not in trained

    server = BundledServer("multiplication", tmp_path / "replay.log")
    try:
        url = server.start()
        use = tool_use(spec.environment, url, Settings())
        turns_of = {ex.question.split("\n")[0]: [t.action for t in ex.meta["episode"].turns] for ex in demos}
        players = Players(engine=Replay(tok, turns_of), tokenizer=tok, tools=use, max_new_tokens=64,
                          turns=turn_format(tok, chat=True, tools=declared(use.tools)), eos_ids=frozenset({tok.eos_token_id}))
        limits = Limits(max_turns=3, max_episode_tokens=400, max_observation_tokens=256, max_concurrent=8, timeout_s=20.0,
                        max_bytes=1 << 20)
        again, _ = play(players, url, [ex.meta["seed"] for ex in demos], 1, limits, seed_of=None, scheduler=Continuous())
    finally:
        server.stop()
    assert all(e.reward("sum") == pytest.approx(1.1) for e in again)  # solved, with the tag
    assert [e.prompt_ids + e.ids for e in again] == [ex.meta["episode"].prompt_ids + ex.meta["episode"].ids for ex in demos]
