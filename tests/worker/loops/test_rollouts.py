"""The shared rollout collector on hand-made groups: what is dropped, refilled and trained on."""

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from service.core.specs import GRPOSpec
from worker.batch import RolloutBatch
from worker.datasets import Example
from worker.loops.draws import Uniform, draw_share, pick
from worker.loops.rollouts import Drawn, Spent, Tied, collect_rollouts
from worker.parallel.distributed import SINGLE, Ranks
from worker.reporting import Reporter
from worker.rewards import FunctionComponent, Scorer, lookup

G, K = 2, 3  # completions per group, groups per unit (a joint query's k documents)


def _batch(texts: list[str]) -> RolloutBatch:
    n = len(texts)
    return RolloutBatch(torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long),
                        torch.ones(n, 3, dtype=torch.long), torch.ones(n, 3, dtype=torch.long),
                        torch.zeros(n, dtype=torch.bool), texts)


def _setup(**grpo) -> SimpleNamespace:
    scorer = Scorer([FunctionComponent("digit_share", 1.0, lookup("digit_share").fn)])
    return SimpleNamespace(spec=SimpleNamespace(grpo=GRPOSpec(**grpo)), scorer=scorer,
                           tokenizer=SimpleNamespace(pad_token_id=0), ranks=SINGLE)


def _drawer(units: list[list[list[str]]]):
    """Hands out the given units in order: each a list of K groups of G completions."""
    queue, calls = list(units), []

    def draw(round: int, n: int) -> Drawn[str]:
        taken = [queue.pop(0) for _ in range(n)]
        calls.append(n)
        groups = [grp for unit in taken for grp in unit]
        return Drawn(_batch([c for grp in groups for c in grp]), [Example("q", ["a"]) for _ in groups],
                     [f"p{len(calls)}" for _ in groups], [str(u) for u in taken], [(round, i) for i in range(n)],
                     groups_per_unit=K)

    return draw, calls


TIED = [["aa", "aa"]] * K  # every group of the unit ties: no signal at all
MIXED = [["1a", "aa"], ["aa", "aa"], ["11", "a1"]]  # its middle group ties


@pytest.mark.usefixtures("digit_reward")
def test_tied_units_are_replaced_and_tied_groups_left_out_of_training():
    draw, calls = _drawer([MIXED, TIED, TIED, MIXED])
    s = _setup(drop_zero_std_groups=True, max_refill_rounds=2, num_generations=G)
    ro = collect_rollouts(s, 1, Reporter(), draw, units=2, group_size=G)
    assert calls == [2, 1, 1]  # the second unit, then its replacement, tied
    assert ro.refill_rounds == 2 and len(ro.units) == 2 and len(ro) == 2 * K * G
    assert ro.frac_zero_std == pytest.approx(4 / 6)  # the first round: 1 + 3 of 6 groups tied
    # the tied middle group of each kept unit stays in the batch (its reward counts for the
    # retriever) but not in training
    assert ro.train_rows == [0, 1, 4, 5, 6, 7, 10, 11]
    assert ro.rewards.view(-1, G)[1].tolist() == [0.0, 0.0]


@pytest.mark.usefixtures("digit_reward")
def test_without_dropping_every_group_is_kept_and_trained_on():
    draw, calls = _drawer([MIXED, TIED])
    ro = collect_rollouts(_setup(num_generations=G), 1, Reporter(), draw, units=2, group_size=G)
    assert calls == [2] and ro.refill_rounds == 0 and ro.train_rows == list(range(2 * K * G))


@pytest.mark.usefixtures("digit_reward")
def test_nothing_to_learn_after_the_last_refill_round():
    draw, calls = _drawer([TIED] * 3)
    s = _setup(drop_zero_std_groups=True, max_refill_rounds=2, num_generations=G)
    tied = collect_rollouts(s, 1, Reporter(), draw, units=1, group_size=G)
    assert isinstance(tied, Tied) and calls == [1, 1, 1]
    m = tied.metrics()  # what the skipped step paid for is still reported: three rounds of K groups of G
    assert m["frac_reward_zero_std"] == 1.0 and m["selection/observed_signal"] == 0.0
    assert (m["selection/rollouts"], m["selection/refill_rollouts"]) == (3 * K * G, 2 * K * G)
    assert m["selection/generated_tokens"] > 0


def test_an_episodes_generated_tokens_are_the_models_own_not_the_observations_between():
    spent = Spent()
    batch = replace(_batch(["a", "b"]), completion_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
                    trained_mask=torch.tensor([[1, 0, 1], [1, 0, 0]]))  # [N=2, T=3]: turn, observation, turn
    spent.add(batch, refill=False)
    spent.add(_batch(["c"]), refill=True)  # a completion: every token of it
    assert (spent.rollouts, spent.tokens, spent.refill_rollouts) == (3, 2 + 1 + 3, 1)


def _unscorable_setup() -> SimpleNamespace:
    """digit_share, except that a completion with an 'x' cannot be scored (the reward returns None)."""
    def fn(completion, answers):
        return None if "x" in completion else lookup("digit_share").fn(completion, answers)
    return SimpleNamespace(spec=SimpleNamespace(grpo=GRPOSpec(num_generations=G)),
                           scorer=Scorer([FunctionComponent("digits_or_none", 1.0, fn)]),
                           tokenizer=SimpleNamespace(pad_token_id=0), ranks=SINGLE)


@pytest.mark.usefixtures("digit_reward")
def test_the_reward_mean_counts_scored_completions_only_and_is_absent_when_none_was():
    draw, _ = _drawer([[["11", "x1"], ["1a", "xx"], ["aa", "x"]]])
    m = collect_rollouts(_unscorable_setup(), 1, Reporter(), draw, units=1, group_size=G).metrics()
    assert m["reward/mean"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)  # not the excluded rows' stand-in means
    draw, _ = _drawer([[["x1", "x"], ["xa", "xx"], ["ax", "x"]]])
    m = collect_rollouts(_unscorable_setup(), 1, Reporter(), draw, units=1, group_size=G).metrics()
    assert "reward/mean" not in m and "reward/std" not in m  # nothing was measured


class _Recording:
    """A prompt draw that keeps what it is told: the seam a draw that learns from rewards plugs into."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], list[list[float]]]] = []

    def draw(self, rng, n: int) -> list[int]:
        return list(range(n))

    def observe(self, picked: list[int], rewards: torch.Tensor) -> None:
        self.seen.append((picked, rewards.tolist()))

    def predicted(self, picked: list[int]) -> float | None:
        return 0.25 * len(self.seen)  # asked before round 0's rewards are told


@pytest.mark.usefixtures("digit_reward")
def test_the_prompt_draw_is_told_every_rounds_rewards_refills_included():
    base, _ = _drawer([MIXED, TIED, MIXED])
    recording = _Recording()

    def draw(round: int, n: int) -> Drawn[str]:
        d = base(round, n)
        return replace(d, picked=[10 * round + i for i in range(n)], drawn_by=recording)

    s = _setup(drop_zero_std_groups=True, max_refill_rounds=2, num_generations=G)
    ro = collect_rollouts(s, 1, Reporter(), draw, units=2, group_size=G)
    # round 0 drew units 0 and 1 (the second tied), round 1 refilled one; rewards [n_units, K * G]
    assert [picked for picked, _ in recording.seen] == [[0, 1], [10]]
    # the draw's prediction is asked once, before round 0's rewards: the step reports it beside what it cost
    m = ro.metrics()
    assert m["selection/predicted_signal"] == 0.0 and m["selection/observed_signal"] == 1.0 - m["frac_reward_zero_std"]
    assert m["selection/rollouts"] == 3 * K * G and m["selection/refill_rollouts"] == K * G
    assert recording.seen[0][1][1] == [0.0] * (K * G) and len(recording.seen[1][1][0]) == K * G


def test_the_uniform_draw_is_the_seeded_draw_every_rank_shares():
    pool = [f"prompt {i}" for i in range(7)]
    rng = random.Random("tag")
    assert pick(pool, draw_share(Uniform(7), random.Random("tag"), 3, SINGLE)) == [pool[rng.randrange(7)] for _ in range(3)]
    whole = draw_share(Uniform(7), random.Random("tag"), 5, SINGLE)
    shares = [draw_share(Uniform(7), random.Random("tag"), 5, Ranks(rank=r, world=2)) for r in range(2)]
    assert shares[0].picked + shares[1].picked == whole.picked and shares[1].index == [3, 4]
    assert Uniform(3, offset=100).draw(random.Random(0), 4) == [100 + i for i in Uniform(3).draw(random.Random(0), 4)]


def test_a_learnability_draw_explores_favours_signal_and_continues_exactly_from_its_state():
    import random

    from worker.loops.draws import Learnability

    draw = Learnability(size=10, group_size=4, threshold=0.5, floor=0.05, offset=100)
    first = draw.draw(random.Random(1), 6)
    assert all(100 <= u < 110 for u in first) and first == Learnability(
        size=10, group_size=4, threshold=0.5, floor=0.05, offset=100).draw(random.Random(1), 6)  # the seed's
    assert draw.predicted([100]) == pytest.approx(1 - 2 / 5)  # the prior's: 1 - 2 / (G + 1)
    # prompts 100-104 always solved, 105-109 solved half the time: after 5 groups each, Beta(21, 1) and
    # Beta(11, 11): 1 - 21/25 - (tiny) against 1 - 2 * (11*12*13*14) / (22*23*24*25)
    rounds = torch.tensor([[1.0] * 4] * 5 + [[1.0, 0.0, 1.0, 0.0]] * 5)
    for _ in range(5):
        draw.observe(list(range(100, 110)), rounds)
    assert draw.predicted([100]) == pytest.approx(4 / 25, abs=1e-3)
    assert draw.predicted([105]) == pytest.approx(1 - 2 * 11 * 12 * 13 * 14 / (22 * 23 * 24 * 25))
    share = sum(u < 105 for u in draw.draw(random.Random(2), 4000)) / 4000
    assert 0.12 < share < 0.2  # the solved ones at their weight, 0.16 / (0.16 + 0.84), not uniform's half
    for _ in range(20):  # 25 groups: Beta(101, 1) predicts 0.038, under the floor of 0.05
        draw.observe(list(range(100, 110)), rounds)
    share = sum(u < 105 for u in draw.draw(random.Random(2), 4000)) / 4000
    assert 0.03 < share < 0.08  # the floor keeps the solved ones drawn, now and then
    seen = Learnability(size=1000, group_size=4, threshold=0.5, floor=0.05)
    seen.observe([3], torch.tensor([[1.0] * 4]))
    assert len({u for u in seen.draw(random.Random(3), 50)} - {3}) > 40  # an unseen prompt is still drawn
    again = Learnability(size=10, group_size=4, threshold=0.5, floor=0.05, offset=100)
    again.load_state_dict(draw.state_dict())  # a resume: the next draw is the straight run's
    assert again.draw(random.Random(4), 20) == draw.draw(random.Random(4), 20)
