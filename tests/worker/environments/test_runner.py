"""Episodes played by a real engine in a real bundled environment, in waves and continuously: every turn
sampled from exactly the episode's ids, the rows' trained ids exactly the sampled ones, the same episodes
either way; a re-tokenizing engine, a dead server and a server with fewer slots than the job asks for."""

import dataclasses
import time

import pytest

from service.core.specs import LoraSpec, ModelSpec
from worker.batch import SamplingParams
from worker.engines.hf_engine import HFEngine, eos_token_ids
from worker.environments.client import EnvironmentFailed
from worker.environments.continuous import Continuous
from worker.environments.episodes import TokenMismatch, rows
from worker.environments.runner import EpisodeStats, Limits, Players, Stopped, Waves, play
from worker.environments.servers import BundledServer
from worker.environments.turns import PlainTurns
from worker.model.loading import load_policy

LIMITS = Limits(max_turns=3, max_episode_tokens=160, max_observation_tokens=48, max_concurrent=3, timeout_s=10.0,
                max_bytes=1 << 20)


@pytest.fixture(scope="module")
def players(tmp_path_factory):
    model, tok = load_policy(ModelSpec(name="tiny-random-llama", lora=LoraSpec(r=4)),
                             models_root=tmp_path_factory.mktemp("models"), device="cpu", seed=0)
    engine = HFEngine(model, tok, "cpu", SamplingParams(max_new_tokens=10, temperature=1.0))
    return Players(engine=engine, tokenizer=tok, turns=PlainTurns(tok), eos_ids=frozenset(eos_token_ids(tok, model)),
                   max_new_tokens=10)


SCHEDULERS = [pytest.param(Waves(), id="waves"), pytest.param(Continuous(), id="continuous")]


@pytest.fixture(scope="module")
def guess(tmp_path_factory):
    server = BundledServer("guess-number", tmp_path_factory.mktemp("env") / "guess.log")
    yield server
    server.stop()


def test_episodes_train_exactly_the_tokens_they_sampled_and_both_schedules_play_the_same(players, guess):
    url = guess.start() if not guess.alive() else guess.url
    episodes, played = play(players, url, [3, 4], 2, LIMITS, seed_of=lambda i, turn: 100 * i + turn,
                            scheduler=Continuous())
    assert [(e.seed, e.g) for e in episodes] == [(3, 0), (3, 1), (4, 0), (4, 1)]  # seed-major groups
    assert all(e.error is None and 1 <= len(e.turns) <= 3 for e in episodes)
    assert episodes[0].first_observation == episodes[1].first_observation  # a group shares its task
    batch = rows(episodes, players.tokenizer.pad_token_id)  # asserts the trained ids are the sampled ones
    for i, e in enumerate(episodes):
        n_env = sum(len(s.ids) for s in e.segments if not s.sampled)
        assert int(batch.completion_mask[i].sum() - batch.trained_mask[i].sum()) == n_env
        assert e.reward("sum") == pytest.approx(sum(t.reward for t in e.turns))
    stats = EpisodeStats.of(episodes, played).metrics()
    assert stats["env/turns_mean"] == sum(len(e.turns) for e in episodes) / 4 and stats["env/error_ratio"] == 0
    assert stats["env/sessions_open_max"] == 3 and stats["env/sessions_refused"] == 0  # max_concurrent 3 of 4
    waves, _ = play(players, url, [3, 4], 2, LIMITS, seed_of=lambda i, turn: 100 * i + turn, scheduler=Waves())
    # seeded turns: the same episodes whichever episodes shared an engine call
    assert [(e.ids, [t.observation for t in e.turns]) for e in waves] == \
        [(e.ids, [t.observation for t in e.turns]) for e in episodes]
    assert guess.sessions()["open"] == 0


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_an_engine_that_re_tokenizes_is_caught(players, guess, scheduler):
    """An engine given text (the conversation decoded and encoded again) instead of the episode's ids."""
    url = guess.start() if not guess.alive() else guess.url
    tok = players.tokenizer

    class Retokenizing:
        def __init__(self, engine):
            self.engine = engine

        def generate(self, prompts, n, **kw):
            batch = self.engine.generate([tok.decode(p) for p in prompts], n, **kw)
            batch.prompt_ids[:, -1] = 7  # where a real tokenizer merges across the boundary differently
            return batch

    bad = dataclasses.replace(players, engine=Retokenizing(players.engine))
    with pytest.raises(TokenMismatch, match="turn 1 was sampled from"):
        play(bad, url, [3], 1, LIMITS, seed_of=lambda i, turn: turn, scheduler=scheduler)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_dead_server_fails_the_step_and_a_death_mid_episode_ends_the_episodes(players, guess, scheduler):
    url = guess.start() if not guess.alive() else guess.url

    class KillsServer:  # the server dies while the model samples the second turn
        def __init__(self, engine):
            self.engine, self.calls = engine, 0

        def generate(self, prompts, n, **kw):
            self.calls += 1
            if self.calls == 2:
                guess.stop()
            return self.engine.generate(prompts, n, **kw)

    dying = dataclasses.replace(players, engine=KillsServer(players.engine))
    episodes, _ = play(dying, url, [5, 6], 1, dataclasses.replace(LIMITS, max_turns=4), seed_of=lambda i, t: t,
                       scheduler=scheduler)
    live_at_kill = [e for e in episodes if len(e.turns) == 2]
    assert live_at_kill and all("closed the session" in e.error or "failed" in e.error for e in live_at_kill)
    rows(episodes, players.tokenizer.pad_token_id)  # what was sampled is still a valid row
    with pytest.raises(EnvironmentFailed, match="no episode could start"):
        play(players, url, [5], 1, LIMITS, seed_of=lambda i, t: t, scheduler=scheduler)


def test_a_cancel_stops_the_episodes_between_turns_and_closes_their_sessions(players, guess):
    """Asked before every wave and turn: once it says stop, no further turn or wave starts (the sessions are
    closed as the wave's exit stack unwinds). The episodes of the 3 later waves are never opened."""
    url = guess.start() if not guess.alive() else guess.url
    asked = []

    def stop() -> bool:  # a cancel heard at the second question: after wave 0's first turn was sent
        asked.append(len(asked))
        return len(asked) > 2

    with pytest.raises(Stopped, match="cancelled at turn 1 of episodes 0..2"):
        play(players, url, [3, 4, 5, 6], 3, LIMITS, seed_of=lambda i, turn: turn, stop=stop, scheduler=Waves())
    assert len(asked) == 3  # before wave 0, its turn 0 and its turn 1: the other three waves never began
    episodes, _ = play(players, url, [3], 3, LIMITS, seed_of=lambda i, turn: turn,
                       scheduler=Continuous())  # the server goes on
    assert all(e.error is None for e in episodes), [e.error for e in episodes]


def test_a_continuous_cancel_stops_every_episode_and_leaves_no_session_open(players, guess):
    url = guess.start() if not guess.alive() else guess.url
    asked = []

    def stop() -> bool:  # heard at the 6th question: the 3 playing episodes ask before opening and each turn
        asked.append(len(asked))
        return len(asked) > 5

    with pytest.raises(Stopped, match="cancelled at turn [01] of episode [0-2]"):
        play(players, url, [3, 4, 5, 6], 3, LIMITS, seed_of=lambda i, turn: turn, stop=stop, scheduler=Continuous())
    assert guess.sessions()["open"] == 0  # counted by the server


def test_a_server_with_one_slot_plays_every_episode_of_a_job_that_asks_for_four(players, tmp_path):
    """openenv's default server holds one session at a time: the others wait for its slot, none is lost."""
    one = BundledServer("guess-number", tmp_path / "one.log", max_sessions=1)
    try:
        url = one.start()
        limits = dataclasses.replace(LIMITS, max_concurrent=4)
        episodes, played = play(players, url, [3, 4], 2, limits, seed_of=lambda i, turn: 100 * i + turn,
                                scheduler=Continuous())
        assert [e.error for e in episodes] == [None] * 4
        assert (played.sessions, one.sessions()) == (1, {"open": 0, "most": 1}) and played.refused > 0
        stats = EpisodeStats.of(episodes, played).metrics()
        assert stats["env/error_ratio"] == 0 and stats["env/sessions_refused"] == played.refused
        alone, _ = play(players, url, [3, 4], 2, dataclasses.replace(LIMITS, max_concurrent=1),
                        seed_of=lambda i, turn: 100 * i + turn, scheduler=Continuous())
        assert [e.ids for e in alone] == [e.ids for e in episodes]  # as if it had asked for one
    finally:
        one.stop()


def test_a_generation_longer_than_the_servers_ping_interval_keeps_its_session(players, tmp_path):
    """The server pings every 0.3 s and closes a session whose pong is late; the model takes 1 s a turn."""
    strict = BundledServer("guess-number", tmp_path / "strict.log", ping_interval_s=0.3)

    class Slow:
        def __init__(self, engine):
            self.engine = engine

        def generate(self, prompts, n, **kw):
            time.sleep(1.0)  # in the engine's thread: the event loop answers the pings meanwhile
            return self.engine.generate(prompts, n, **kw)

    try:
        url = strict.start()
        slow = dataclasses.replace(players, engine=Slow(players.engine))
        episodes, _ = play(slow, url, [3], 2, dataclasses.replace(LIMITS, max_turns=2), seed_of=lambda i, t: t,
                           scheduler=Continuous())
        assert [e.error for e in episodes] == [None, None] and all(e.turns for e in episodes)
    finally:
        strict.stop()
