"""Episodes played turn by turn: every live episode's next turn sampled in one engine call, then every
environment step awaited at once.

Which episodes play side by side is the scheduler's (`EpisodeScheduler`; today `Waves`). A wave of at most
`max_concurrent` episodes opens one session each, resets them (a group's episodes share a seed), and then,
turn after turn, samples each live episode's turn from exactly its ids so far
(checked against the ids the engine reports it sampled from), sends the text to the environment, and
appends the environment's answer as tokens of its own (worker/environments/turns.py). An environment
that fails one episode ends that episode with the error; one that fails every episode of a wave before
any turn (down, refusing sessions) fails the step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from worker.batch import RolloutEngine
from worker.environments.acting import Outcome, ToolUse, act, cut_observation, observation_text
from worker.environments.client import EnvironmentDown, EnvironmentFailed, Session, StepResult
from worker.environments.episodes import Episode, Segment, Turn
from worker.environments.limits import Limits
from worker.environments.turns import TurnFormat


@dataclass(frozen=True)
class Players:
    """What plays an episode's turns."""

    engine: RolloutEngine
    tokenizer: object
    turns: TurnFormat
    eos_ids: frozenset[int]
    max_new_tokens: int  # per turn: an episode with fewer tokens left than this is not given another turn
    tools: ToolUse = ToolUse()  # how a turn reaches the environment (its text, or tool calls)

    async def act(self, session: Session, e: Episode, text: str, limits: Limits) -> Outcome | None:
        """The environment's answer to episode `e`'s turn `text`; None with the episode ended by the
        environment's error."""
        def prompt() -> str:  # a response parser's context: the end of the turn's prompt, decoded only if asked
            before = e.context[:len(e.context) - len(e.segments[-1].ids)]
            return self.tokenizer.decode(before[-256:])

        return await guarded(act(self.tokenizer, session, text, self.tools, limits, prompt), e)


T = TypeVar("T")
TurnSeed = Callable[[int, int], int]  # (episode index, turn) -> that turn's sampling seed


@dataclass(frozen=True)
class Played:
    """What playing a step's episodes cost besides their tokens."""

    env_s: float  # wall time the engine waited on the environment
    sessions: int  # sessions open on the server at once, at most
    refused: int = 0  # sessions the server refused (every slot taken) and the episode waited out


class Stopped(Exception):
    """The job was cancelled while its episodes played: no further wave or turn was started, and every
    session was closed (the step is dropped; it made no update)."""


async def guarded(coro: Awaitable[T], episode: Episode) -> T | None:
    """The environment's answer, or None with the episode ended by its error."""
    try:
        return await coro
    except EnvironmentFailed as exc:
        episode.error = str(exc)
        return None


async def _start(p: Players, url: str, episodes: list[Episode], limits: Limits,
                 stack: AsyncExitStack) -> list[Session | None]:
    """A session per episode, reset to its seed and its first prompt set; None where the environment failed
    it. EnvironmentFailed when it failed every one (down, refusing sessions)."""

    async def open_session(e: Episode) -> Session | None:
        try:
            return await stack.enter_async_context(Session(url, timeout_s=limits.timeout_s, max_bytes=limits.max_bytes))
        except EnvironmentFailed as exc:
            e.error = str(exc)
            return None

    sessions = await asyncio.gather(*(open_session(e) for e in episodes))
    resets = await asyncio.gather(*(guarded(s.reset(e.seed, e.split), e) if s is not None else asyncio.sleep(0)
                                    for s, e in zip(sessions, episodes)))
    if all(r is None for r in resets):
        raise EnvironmentDown(f"no episode could start: {episodes[0].error}")
    for e, r in zip(episodes, resets):
        if r is not None:
            first_prompt(p, e, r, limits)
    return sessions


def first_prompt(p: Players, e: Episode, reset: StepResult, limits: Limits) -> None:
    """The episode's first prompt, from its reset's observation."""
    text, cut = cut_observation(p.tokenizer, observation_text(reset, limits.observation_field),
                                limits.max_observation_tokens)  # the task, as the first user message
    e.first_observation, e.observations_cut, e.done = text, int(cut), reset.done
    e.prompt_ids = p.turns.first(text)


def sample_turn(p: Players, live: list[Episode], seeds: list[int] | None) -> list[tuple[str, bool]]:
    """Each live episode's next turn, sampled from exactly its ids and appended; (its text, ended with EOS)."""
    batch = p.engine.generate([e.context for e in live], 1, seeds=seeds, greedy=seeds is None)
    out = []
    for row, e in enumerate(live):
        e.check_sampled_from(batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist())
        real = batch.completion_mask[row].bool()
        ids = batch.completion_ids[row][real].tolist()
        logp = None if batch.sampler_logp is None else tuple(batch.sampler_logp[row][real].tolist())
        e.segments.append(Segment(ids=tuple(ids), sampled=True, logprobs=logp))
        out.append((batch.completions[row], bool(ids) and ids[-1] in p.eos_ids))
    return out


def answered(p: Players, e: Episode, text: str, eos: bool, r: Outcome | None, limits: Limits, last: bool) -> None:
    """The environment's answer `r` to the episode's turn `text` recorded, and its replies appended as
    tokens when the episode goes on (done, failed, or out of turns or tokens: it ends here)."""
    if r is None:  # the environment failed it: the turn stays, unanswered
        e.turns.append(Turn(action=text, observation=None, reward=None))
        return
    e.observations_cut += r.cut
    e.turns.append(Turn(action=text, observation=r.text, reward=r.reward, tool_calls=r.tool_calls,
                        tool_errors=r.tool_errors, malformed_calls=r.malformed))
    if r.done:
        e.done = True
        return
    between = p.turns.between(r.replies, ended_with_eos=eos)
    room = limits.max_episode_tokens - len(e.ids) - len(between)
    if last or room < min(p.max_new_tokens, limits.max_episode_tokens // 4):
        e.truncated = True  # no room for another turn: what it earned so far is its reward
        return
    e.segments.append(Segment(ids=tuple(between), sampled=False))


async def _wave(p: Players, url: str, episodes: list[Episode], limits: Limits, seed_of: TurnSeed | None,
                first: int, stop: Callable[[], bool]) -> Played:
    """Play `episodes` (indices first.. in the step) to the end. Stopped, with the sessions closed, when
    `stop()` says so before a turn."""
    async with AsyncExitStack() as stack:
        t0 = time.monotonic()
        sessions = await _start(p, url, episodes, limits, stack)
        env_s = time.monotonic() - t0
        for turn in range(limits.max_turns):
            live = [(i, e) for i, e in enumerate(episodes) if e.live]
            if not live:
                break
            if await asyncio.to_thread(stop):
                raise Stopped(f"cancelled at turn {turn} of episodes {first}..{first + len(episodes) - 1}")
            seeds = None if seed_of is None else [seed_of(first + i, turn) for i, _ in live]
            actions = await asyncio.to_thread(sample_turn, p, [e for _, e in live], seeds)
            t0 = time.monotonic()
            answers = await asyncio.gather(*(p.act(sessions[i], e, text, limits)
                                             for (i, e), (text, _) in zip(live, actions)))
            env_s += time.monotonic() - t0
            for (_, e), (text, eos), r in zip(live, actions, answers):
                answered(p, e, text, eos, r, limits, last=turn == limits.max_turns - 1)
    return Played(env_s=env_s, sessions=sum(s is not None for s in sessions))


class EpisodeScheduler(Protocol):
    """How a step's episodes advance: which of them play side by side, and when one starts."""

    def run(self, p: Players, url: str, episodes: list[Episode], limits: Limits, *, seed_of: TurnSeed | None,
            stop: Callable[[], bool]) -> Played:
        """Every one of `episodes` played to its end; what it cost. Stopped, with every session closed,
        once `stop()` says so."""
        ...


@dataclass(frozen=True)
class Waves:
    """Episodes in waves of at most `limits.max_concurrent`: a wave opens its sessions together, plays
    turn by turn (every live episode's turn in one engine call) and closes before the next wave opens."""

    def run(self, p: Players, url: str, episodes: list[Episode], limits: Limits, *, seed_of: TurnSeed | None,
            stop: Callable[[], bool]) -> Played:
        waves = []
        for at in range(0, len(episodes), limits.max_concurrent):
            if stop():
                raise Stopped(f"cancelled before episodes {at}..{len(episodes) - 1}")
            waves.append(asyncio.run(_wave(p, url, episodes[at:at + limits.max_concurrent], limits, seed_of, at, stop)))
        return Played(env_s=sum(w.env_s for w in waves), sessions=max((w.sessions for w in waves), default=0))


def play(p: Players, url: str, seeds: list[int], group_size: int, limits: Limits, *, seed_of: TurnSeed | None,
         scheduler: EpisodeScheduler, stop: Callable[[], bool] = lambda: False,
         split: str | None = None) -> tuple[list[Episode], Played]:
    """`group_size` episodes per reset seed, seed-major [len(seeds) * G], played as `scheduler` runs them
    (`split`: the seeds are task indices of that split, the Task API's); `seed_of` None: greedy turns.
    Returns the episodes and what playing them cost. `stop()` is asked before every turn (a cancel): once it
    says so, Stopped, with every session closed."""
    episodes = [Episode(seed=s, g=g, prompt_ids=[], first_observation="", split=split)
                for s in seeds for g in range(group_size)]
    return episodes, scheduler.run(p, url, episodes, limits, seed_of=seed_of, stop=stop)


@dataclass(frozen=True)
class EpisodeStats:
    """A step's episodes, summed up as metrics."""

    episodes: int
    turns: float
    tool_calls: float
    tool_errors: float
    malformed_calls: float
    tokens: float  # after the first prompt, the model's and the environment's
    truncated: float
    errors: float
    observations_cut: float
    env_s: float
    refused: float = 0.0  # sessions the server refused at capacity and the episode waited out
    sessions: int = 0  # sessions open at once, at most (the most of a step's rounds)
    failures: Mapping[str, int] = field(default_factory=dict)  # the environment's errors, in its words: episodes each

    @staticmethod
    def of(episodes: list[Episode], played: Played) -> EpisodeStats:
        return EpisodeStats(episodes=len(episodes), turns=sum(len(e.turns) for e in episodes),
                            tool_calls=sum(t.tool_calls for e in episodes for t in e.turns),
                            tool_errors=sum(t.tool_errors for e in episodes for t in e.turns),
                            malformed_calls=sum(t.malformed_calls for e in episodes for t in e.turns),
                            tokens=sum(len(e.ids) for e in episodes), truncated=sum(e.truncated for e in episodes),
                            errors=sum(e.error is not None for e in episodes),
                            observations_cut=sum(e.observations_cut for e in episodes), env_s=played.env_s,
                            refused=played.refused, sessions=played.sessions,
                            failures=Counter(e.error for e in episodes if e.error is not None))

    @staticmethod
    def total(parts: list[EpisodeStats]) -> EpisodeStats | None:
        """The sum of `parts` (a step's rounds); None for none."""
        if not parts:
            return None
        summed = [f.name for f in dataclasses.fields(EpisodeStats) if f.name not in ("sessions", "failures")]
        return EpisodeStats(**{n: sum(getattr(p, n) for p in parts) for n in summed},
                            sessions=max(p.sessions for p in parts),
                            failures=sum((Counter(p.failures) for p in parts), Counter()))

    def why(self) -> str | None:
        """The environment's failures in its own words, most frequent first; None when none failed."""
        if not self.failures:
            return None
        ranked = sorted(self.failures.items(), key=lambda kv: -kv[1])
        said = "; ".join(f"{text[:300]} ({n}x)" for text, n in ranked[:2])
        more = f"; and {len(ranked) - 2} other errors" if len(ranked) > 2 else ""
        return f"{int(self.errors)} of {self.episodes} episodes failed: {said}{more}"

    def metrics(self) -> dict[str, float]:
        n = max(self.episodes, 1)
        return {"env/turns_mean": self.turns / n, "env/tool_calls_mean": self.tool_calls / n,
                "env/tool_errors_mean": self.tool_errors / n, "env/tool_parse_errors": self.malformed_calls,
                "env/episode_tokens_mean": self.tokens / n,
                "env/truncated_ratio": self.truncated / n, "env/error_ratio": self.errors / n,
                "env/observations_cut": self.observations_cut, "env/sessions_open_max": float(self.sessions),
                "env/sessions_refused": self.refused, "time/env_s": self.env_s}


@dataclass
class StepTally:
    """The training episodes each step played, every round of it, for the step's end to read whether
    they failed (a step whose groups all tied has no rollouts to carry them)."""

    played: dict[int, list[EpisodeStats]] = field(default_factory=dict)

    def add(self, step: int, stats: EpisodeStats) -> None:
        self.played.setdefault(step, []).append(stats)

    def take(self, step: int) -> EpisodeStats | None:
        """Step `step`'s episodes, summed; forgotten with every step before it."""
        out = EpisodeStats.total(self.played.pop(step, []))
        for earlier in [k for k in self.played if k < step]:
            del self.played[earlier]
        return out


def episode_rewards(episodes: list[Episode], how: str) -> torch.Tensor:
    """[N] each episode's reward (0 for one the environment failed before any reward)."""
    r = torch.tensor([e.reward(how) for e in episodes], dtype=torch.float32)
    if not all(math.isfinite(x) for x in r.tolist()):
        raise EnvironmentFailed("the environment's rewards are not finite")
    return r
