"""A job's environment: its server (a bundled one started here, or the spec's URL, checked against the
admin's allow-list again), and what plays and bounds its episodes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from service.core.grader_urls import check_url
from service.core.settings import Settings
from service.core.specs import EnvironmentSpec
from worker.batch import RolloutEngine
from worker.environments.acting import ToolUse, declared
from worker.environments.client import EnvironmentFailed, Slots, opened
from worker.environments.continuous import Continuous
from worker.environments.runner import EpisodeScheduler, Limits, Players, StepTally
from worker.environments.servers import BundledServer
from worker.environments.tasks import TaskSet, count_tasks
from worker.environments.tools import Tool, renders_tools
from worker.environments.turns import TemplateRefused, turn_format

# Reset seeds: training draws below EVAL_SEEDS, evaluation plays EVAL_SEEDS, EVAL_SEEDS + 1, ...
EVAL_SEEDS = 2**31


@dataclass(frozen=True)
class Units:
    """What a job's episodes are drawn among: `count` indices from `first`, tasks of `split` (the Task API's)
    or, without a split, reset seeds."""

    count: int
    first: int = 0
    split: str | None = None


@dataclass(frozen=True)
class EnvironmentHost:
    spec: EnvironmentSpec
    url: str  # the OpenEnv server's base URL
    players: Players
    limits: Limits
    stop: Callable[[], bool]  # a cancel, asked before each wave and turn of episodes
    scheduler: EpisodeScheduler = Continuous()  # how a step's episodes advance
    tally: StepTally = field(default_factory=StepTally)  # each step's training episodes, for its health reading
    tasks: TaskSet | None = None  # the Task API's splits, where the spec draws tasks instead of reset seeds

    def training_units(self) -> Units:
        """What training draws among: tasks of the train split, or reset seeds below EVAL_SEEDS."""
        if self.tasks is not None:
            return Units(self.tasks.train_tasks, split=self.tasks.train)
        return Units(EVAL_SEEDS)

    def evaluation_units(self) -> Units:
        """What evaluation plays: the eval split's first eval_episodes tasks, or eval_episodes reset seeds
        from EVAL_SEEDS."""
        if self.tasks is not None:
            return Units(min(self.spec.eval_episodes, self.tasks.eval_tasks), split=self.tasks.eval)
        return Units(self.spec.eval_episodes, first=EVAL_SEEDS)


def limits_of(spec: EnvironmentSpec, settings: Settings) -> Limits:
    """What bounds the spec's episodes, with the admin's cap on a message's size."""
    return Limits(max_turns=spec.max_turns, max_episode_tokens=spec.max_episode_tokens,
                  max_observation_tokens=spec.max_observation_tokens, max_concurrent=spec.max_concurrent,
                  timeout_s=spec.timeout_s, max_bytes=settings.environment_max_message_bytes,
                  action_field=spec.action_field, observation_field=spec.observation_field)


def tool_use(spec: EnvironmentSpec, url: str, settings: Settings) -> ToolUse:
    """The tools the job's model is shown: none, the spec's declared ones, or the server's MCP tools (listed
    now, in a session of their own)."""
    if spec.tools is None:
        return ToolUse()
    if spec.tools != "mcp":
        return ToolUse(tools=tuple(Tool(t.name, t.description, t.parameters) for t in spec.tools))

    async def listed() -> list[dict]:
        async with opened(url, 0, timeout_s=spec.timeout_s, max_bytes=settings.environment_max_message_bytes,
                          slots=Slots()) as (session, _):
            return await session.list_tools()

    tools = tuple(Tool.of_mcp(t) for t in asyncio.run(listed()))
    if not tools:
        raise EnvironmentFailed("environment.tools is mcp, but the server lists no MCP tools")
    return ToolUse(tools=tools, mcp=True)


def open_environment(spec: EnvironmentSpec, settings: Settings, *, engine: RolloutEngine, tokenizer,
                     eos_ids: set[int], chat: bool, max_new_tokens: int, log_dir: Path,
                     stop: Callable[[], bool] = lambda: False) -> EnvironmentHost:
    """The job's environment, ready: the URL on the allow-list (UrlRefused otherwise), a bundled server
    started and healthy, its tools listed, and the chat template checked to show them and to extend turn by
    turn (TemplateRefused otherwise)."""
    if spec.name is not None:  # ended with the job's loop (servers.stop_servers, from the job host)
        url = BundledServer(spec.name, log_dir / f"environment-{spec.name}.log").start()
    else:
        assert spec.url is not None
        url = str(check_url(spec.url, settings.environment_urls, "GRPO_ENVIRONMENT_URLS", what="environment servers"))
    use = tool_use(spec, url, settings)
    if use.tools and not (chat and renders_tools(tokenizer)):
        raise TemplateRefused("environment.tools: the model's chat template does not show tools to the model; set "
                              "model.chat_template: chatml-tools (a ChatML model), or use a model whose template has "
                              "a tools branch")
    turns = turn_format(tokenizer, chat=chat, tools=declared(use.tools))
    limits = limits_of(spec, settings)
    players = Players(engine=engine, tokenizer=tokenizer, turns=turns, eos_ids=frozenset(eos_ids),
                      max_new_tokens=max_new_tokens, tools=use)
    tasks = None if spec.tasks is None else count_tasks(url, spec.tasks, timeout_s=spec.timeout_s)
    return EnvironmentHost(spec=spec, url=url, players=players, limits=limits, stop=stop, tasks=tasks)
