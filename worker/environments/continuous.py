"""Continuous episodes: each episode's next turn is sampled as soon as its observation arrives.

Up to `max_concurrent` episodes hold a session at once; an episode that ends frees its slot for the next.
An episode whose observation has arrived waits for the engine; the engine takes every waiting episode in
one call, once no other episode is about to join (none is waiting on the environment) or the first has
lingered `linger_s`. A slow environment step holds back its own episode only, where a wave waits for its
slowest. Each turn is sampled with the seed of (its episode's index in the step, the turn), so the same
seeds give the same episodes as waves do, whatever the batches.

A server at capacity refuses a session; the episode waits for a slot (client.opened) while the step's
other episodes play, so a server with one slot plays every episode, one at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.environments.client import EnvironmentDown, EnvironmentFailed, Slots, opened
from worker.environments.episodes import Episode
from worker.environments.runner import (
    Limits,
    Played,
    Players,
    Stopped,
    TurnSeed,
    answered,
    first_prompt,
    sample_turn,
)


@dataclass
class _Engine:
    """The episodes waiting for their next turn, sampled together."""

    p: Players
    seed_of: TurnSeed | None
    linger_s: float
    waiting: list[tuple[int, Episode, int, asyncio.Future[tuple[str, bool]]]] = field(default_factory=list)
    active: int = 0  # episodes holding a slot and not waiting here (at the environment): about to join
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    sampling_s: float = 0.0
    stopped: bool = False  # a cancel was heard: no episode asks again or starts

    async def turn(self, i: int, e: Episode, turn: int) -> tuple[str, bool]:
        """Episode `i`'s next turn (its text, ended with EOS), sampled in the next engine call."""
        done: asyncio.Future[tuple[str, bool]] = asyncio.get_running_loop().create_future()
        self.waiting.append((i, e, turn, done))
        self.left()
        try:
            return await done
        finally:
            self.active += 1

    def left(self) -> None:
        """An active episode is waiting here, or has ended."""
        self.active -= 1
        self.changed.set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.waiting:
                self.changed.clear()
                await self.changed.wait()
            until = loop.time() + self.linger_s
            while self.active and (left := until - loop.time()) > 0:  # let episodes about to be ready join
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except TimeoutError:
                    break
            batch, self.waiting = self.waiting, []
            seeds = None if self.seed_of is None else [self.seed_of(i, turn) for i, _, turn, _ in batch]
            t0 = time.monotonic()
            try:
                out = await asyncio.to_thread(sample_turn, self.p, [e for _, e, _, _ in batch], seeds)
            except Exception as exc:  # a TokenMismatch, say: every episode of the call fails the step with it
                for *_, done in batch:
                    done.set_exception(exc)
                continue
            finally:
                self.sampling_s += time.monotonic() - t0
            for (*_, done), result in zip(batch, out):
                done.set_result(result)


async def _episode(i: int, e: Episode, p: Players, url: str, limits: Limits, engine: _Engine, slots: Slots,
                   free: asyncio.Semaphore, stop: Callable[[], bool]) -> None:
    async with free:
        engine.active += 1
        try:
            await _played(i, e, p, url, limits, engine, slots, stop)
        finally:
            engine.left()


async def _played(i: int, e: Episode, p: Players, url: str, limits: Limits, engine: _Engine, slots: Slots,
                  stop: Callable[[], bool]) -> None:
    """Episode `i` played to its end in a session of its own."""
    if engine.stopped:  # the slot a stopped episode freed: the step is ending, this episode never starts
        return
    if await asyncio.to_thread(stop):
        engine.stopped = True
        raise Stopped(f"cancelled before episode {i}")
    try:
        async with opened(url, e.seed, timeout_s=limits.timeout_s, max_bytes=limits.max_bytes,
                          slots=slots, split=e.split) as (session, first):
            first_prompt(p, e, first, limits)
            for turn in range(limits.max_turns):
                if not e.live:
                    break
                if await asyncio.to_thread(stop):
                    engine.stopped = True
                    raise Stopped(f"cancelled at turn {turn} of episode {i}")
                text, eos = await engine.turn(i, e, turn)
                r = await p.act(session, e, text, limits)
                answered(p, e, text, eos, r, limits, last=turn == limits.max_turns - 1)
    except EnvironmentFailed as exc:  # it could not open, or its reset failed
        e.error = str(exc)


async def _play(p: Players, url: str, episodes: list[Episode], limits: Limits, seed_of: TurnSeed | None,
                stop: Callable[[], bool], linger_s: float) -> Played:
    engine, free, slots = _Engine(p, seed_of, linger_s), asyncio.Semaphore(limits.max_concurrent), Slots()
    t0 = time.monotonic()
    server = asyncio.create_task(engine.serve())
    try:
        async with asyncio.TaskGroup() as tasks:  # the first to raise (a cancel) cancels the rest
            for i, e in enumerate(episodes):
                tasks.create_task(_episode(i, e, p, url, limits, engine, slots, free, stop))
    except BaseExceptionGroup as group:  # a cancel first, else what failed first (a TokenMismatch, say)
        raise next((x for x in group.exceptions if isinstance(x, Stopped)), group.exceptions[0]) from None
    finally:
        server.cancel()
    if episodes and all(not e.prompt_ids for e in episodes):
        raise EnvironmentDown(f"no episode could start: {episodes[0].error}")
    return Played(env_s=max(time.monotonic() - t0 - engine.sampling_s, 0.0), sessions=slots.most,
                  refused=slots.refused)


@dataclass(frozen=True)
class Continuous:
    """Each episode's next turn sampled as soon as its observation arrives (see the module's docstring)."""

    linger_s: float = 0.05  # how long a ready turn waits for episodes still at the environment to join it

    def run(self, p: Players, url: str, episodes: list[Episode], limits: Limits, *, seed_of: TurnSeed | None,
            stop: Callable[[], bool]) -> Played:
        return asyncio.run(_play(p, url, episodes, limits, seed_of, stop, self.linger_s))
