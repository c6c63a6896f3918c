"""Tool calls in real episodes: a scripted model (the turns a model that has learned the tool would
write) plays the bundled multiplication environment over MCP, served by openenv-core 0.3's create_app
and by openenv 0.10's. Its `<tool_call>`s reach the server as `tools/call`s, the results come back as
tool messages the loss never trains, a malformed call is answered and counted, and the right answer
earns the reward."""

import re

import pytest

from service.core.settings import Settings
from service.core.specs import EnvironmentSpec, ModelSpec
from worker.environments.continuous import Continuous
from worker.environments.demos import written
from worker.environments.episodes import rows
from worker.environments.host import tool_use
from worker.environments.runner import EpisodeStats, Limits, Players, play
from worker.environments.servers import BundledServer
from worker.environments.turns import ChatTurns
from worker.model.loading import load_tokenizer

LIMITS = Limits(max_turns=3, max_episode_tokens=400, max_observation_tokens=64, max_concurrent=4, timeout_s=20.0,
                max_bytes=1 << 20)


class Scripted:
    """Turn 1: a malformed call on odd episodes' first try, else the calculator on the question's numbers;
    turn 2: the number the tool answered (a call again after an error), as <answer>."""

    def __init__(self, tok):
        self.tok = tok

    def _turn(self, context: str) -> str:
        if "<tool_response>" not in context:
            a, b = re.search(r"What is (\d+) \* (\d+)", context).groups()
            if int(a) % 2:  # odd: misnames the argument
                return '<tool_call>{"name": "calculator", "arguments": {"expr": ' + f'"{a}*{b}"' + '}</tool_call>'
            return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}\n</tool_call>'
        last = context.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
        if not last.isdigit():  # the call failed: make it as it should be made
            a, b = re.search(r"What is (\d+) \* (\d+)", context).groups()
            return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}\n</tool_call>'
        return f"<answer>{last}</answer>"

    def generate(self, prompts, n, *, seeds=None, greedy=False):
        return written(self.tok, prompts, [self._turn(self.tok.decode(p)) for p in prompts])


@pytest.fixture(scope="module", params=["openenv-core 0.3", "openenv 0.10"])
def multiplication(request, tmp_path_factory):
    """The bundled environment's server, under the service's openenv-core or under openenv 0.10's own
    environment (`make openenv`), whose create_app makes it."""
    python = None if request.param == "openenv-core 0.3" else request.getfixturevalue("openenv_python")
    server = BundledServer("multiplication", tmp_path_factory.mktemp("env") / "multiplication.log", python=python)
    yield server.start()
    server.stop()


def test_a_model_that_calls_the_tool_solves_what_it_cannot_in_its_head(multiplication, models_root):
    tok = load_tokenizer(ModelSpec(name="smollm2-135m-instruct", chat_template="chatml-tools"),
                         models_root=models_root)
    use = tool_use(EnvironmentSpec(url=multiplication, tools="mcp"), multiplication, Settings())
    assert [t.name for t in use.tools] == ["calculator"] and use.mcp
    players = Players(engine=Scripted(tok), tokenizer=tok, turns=ChatTurns.of(tok, [t.schema() for t in use.tools]),
                      eos_ids=frozenset({tok.eos_token_id}), max_new_tokens=64, tools=use)
    seeds = [1, 2, 3, 4]
    episodes, played = play(players, multiplication, seeds, 1, LIMITS, seed_of=lambda i, t: t, scheduler=Continuous())
    assert [e.error for e in episodes] == [None] * 4 and all(e.done for e in episodes)
    for e in episodes:
        assert e.turns[-1].reward == pytest.approx(1.1) and e.turns[-1].observation == "Correct."
        tool_turns = e.turns[:-1]
        assert all(t.tool_calls == 1 or t.malformed_calls == 1 for t in tool_turns) and tool_turns[-1].tool_calls == 1
    malformed = [e for e in episodes if e.turns[0].malformed_calls]
    assert malformed and all(e.turns[0].observation.startswith("error: ") for e in malformed)
    stats = EpisodeStats.of(episodes, played).metrics()
    assert stats["env/tool_parse_errors"] == len(malformed) and stats["env/tool_calls_mean"] == 1.0
    batch = rows(episodes, tok.pad_token_id)
    for i in range(len(episodes)):  # a tool's answer is in the row, never trained
        trained = tok.decode(batch.completion_ids[i][batch.loss_mask()[i].bool()])
        context = tok.decode(batch.completion_ids[i][batch.completion_mask[i].bool()])
        assert "<tool_response>" in context and "<tool_response>" not in trained
        assert "<tool_call>" in trained and trained.endswith("</answer><|im_end|>")
