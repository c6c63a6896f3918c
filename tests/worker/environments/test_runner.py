"""Episodes played by a real engine in a real bundled environment: every turn sampled from exactly the
episode's ids, the rows' trained ids exactly the sampled ones; a re-tokenizing engine and a dead server
are caught."""

import dataclasses

import pytest

from service.core.specs import LoraSpec, ModelSpec
from worker.batch import SamplingParams
from worker.engines.hf_engine import HFEngine, eos_token_ids
from worker.environments.client import EnvironmentFailed
from worker.environments.episodes import TokenMismatch, rows
from worker.environments.runner import EpisodeStats, Limits, Players, Stopped, play
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


@pytest.fixture(scope="module")
def guess(tmp_path_factory):
    server = BundledServer("guess-number", tmp_path_factory.mktemp("env") / "guess.log")
    yield server
    server.stop()


def test_episodes_train_exactly_the_tokens_they_sampled(players, guess):
    url = guess.start() if not guess.alive() else guess.url
    episodes, env_s = play(players, url, [3, 4], 2, LIMITS, seed_of=lambda i, turn: 100 * i + turn)
    assert [(e.seed, e.g) for e in episodes] == [(3, 0), (3, 1), (4, 0), (4, 1)]  # seed-major groups
    assert all(e.error is None and 1 <= len(e.turns) <= 3 for e in episodes)
    assert episodes[0].first_observation == episodes[1].first_observation  # a group shares its task
    batch = rows(episodes, players.tokenizer.pad_token_id)  # asserts the trained ids are the sampled ones
    for i, e in enumerate(episodes):
        n_env = sum(len(s.ids) for s in e.segments if not s.sampled)
        assert int(batch.completion_mask[i].sum() - batch.trained_mask[i].sum()) == n_env
        assert e.reward("sum") == pytest.approx(sum(t.reward for t in e.turns))
    stats = EpisodeStats.of(episodes, env_s).metrics()
    assert stats["env/turns_mean"] == sum(len(e.turns) for e in episodes) / 4 and stats["env/error_ratio"] == 0
    again, _ = play(players, url, [3, 4], 2, LIMITS, seed_of=lambda i, turn: 100 * i + turn)
    assert [e.ids for e in again] == [e.ids for e in episodes]  # seeded turns: reproducible


def test_an_engine_that_re_tokenizes_is_caught(players, guess):
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
        play(bad, url, [3], 1, LIMITS, seed_of=lambda i, turn: turn)


def test_a_dead_server_fails_the_step_and_a_death_mid_episode_ends_the_episodes(players, guess):
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
    episodes, _ = play(dying, url, [5, 6], 1, dataclasses.replace(LIMITS, max_turns=4), seed_of=lambda i, t: t)
    live_at_kill = [e for e in episodes if len(e.turns) == 2]
    assert live_at_kill and all("closed the session" in e.error or "failed" in e.error for e in live_at_kill)
    rows(episodes, players.tokenizer.pad_token_id)  # what was sampled is still a valid row
    with pytest.raises(EnvironmentFailed, match="no episode could start"):
        play(players, url, [5], 1, LIMITS, seed_of=lambda i, t: t)


def test_a_cancel_stops_the_episodes_between_turns_and_closes_their_sessions(players, guess):
    """Asked before every wave and turn: once it says stop, no further turn or wave starts (the sessions are
    closed as the wave's exit stack unwinds). The episodes of the 3 later waves are never opened."""
    url = guess.start() if not guess.alive() else guess.url
    asked = []

    def stop() -> bool:  # a cancel heard at the second question: after wave 0's first turn was sent
        asked.append(len(asked))
        return len(asked) > 2

    with pytest.raises(Stopped, match="cancelled at turn 1 of episodes 0..2"):
        play(players, url, [3, 4, 5, 6], 3, LIMITS, seed_of=lambda i, turn: turn, stop=stop)
    assert len(asked) == 3  # before wave 0, its turn 0 and its turn 1: the other three waves never began
    episodes, _ = play(players, url, [3], 3, LIMITS, seed_of=lambda i, turn: turn)  # the server goes on
    assert all(e.error is None for e in episodes), [e.error for e in episodes]
