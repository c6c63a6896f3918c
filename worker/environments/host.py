"""A job's environment: its server (a bundled one started here, or the spec's URL, checked against the
admin's allow-list again), and what plays and bounds its episodes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from service.core.grader_urls import check_url
from service.core.settings import Settings
from service.core.specs import EnvironmentSpec
from worker.batch import RolloutEngine
from worker.environments.continuous import Continuous
from worker.environments.runner import EpisodeScheduler, Limits, Players, StepTally
from worker.environments.servers import BundledServer
from worker.environments.turns import turn_format


@dataclass(frozen=True)
class EnvironmentHost:
    spec: EnvironmentSpec
    url: str  # the OpenEnv server's base URL
    players: Players
    limits: Limits
    stop: Callable[[], bool]  # a cancel, asked before each wave and turn of episodes
    scheduler: EpisodeScheduler = Continuous()  # how a step's episodes advance
    tally: StepTally = field(default_factory=StepTally)  # each step's training episodes, for its health reading


def open_environment(spec: EnvironmentSpec, settings: Settings, *, engine: RolloutEngine, tokenizer,
                     eos_ids: set[int], chat: bool, max_new_tokens: int, log_dir: Path,
                     stop: Callable[[], bool] = lambda: False) -> EnvironmentHost:
    """The job's environment, ready: the chat template checked to extend turn by turn (TemplateRefused
    otherwise), the URL on the allow-list (UrlRefused otherwise), a bundled server started and healthy."""
    turns = turn_format(tokenizer, chat=chat)
    if spec.name is not None:  # ended with the job's loop (servers.stop_servers, from the job host)
        url = BundledServer(spec.name, log_dir / f"environment-{spec.name}.log").start()
    else:
        assert spec.url is not None
        url = str(check_url(spec.url, settings.environment_urls, "GRPO_ENVIRONMENT_URLS", what="environment servers"))
    limits = Limits(max_turns=spec.max_turns, max_episode_tokens=spec.max_episode_tokens,
                    max_observation_tokens=spec.max_observation_tokens, max_concurrent=spec.max_concurrent,
                    timeout_s=spec.timeout_s, max_bytes=settings.environment_max_message_bytes,
                    action_field=spec.action_field, observation_field=spec.observation_field)
    players = Players(engine=engine, tokenizer=tokenizer, turns=turns, eos_ids=frozenset(eos_ids),
                      max_new_tokens=max_new_tokens)
    return EnvironmentHost(spec=spec, url=url, players=players, limits=limits, stop=stop)
