"""Training rows from episodes, checked against hand-built ids, masks and log-probs."""

import pytest
import torch

from worker.environments.episodes import Episode, Segment, TokenMismatch, Turn, check_rows, record, rows

PAD = 0


def _episode(seed, prompt, *segments, logp=True):
    e = Episode(seed=seed, g=0, prompt_ids=list(prompt), first_observation="obs")
    for ids, sampled in segments:
        lp = tuple(-0.5 - 0.1 * i for i in range(len(ids))) if sampled and logp else None
        e.segments.append(Segment(ids=tuple(ids), sampled=sampled, logprobs=lp))
    e.turns.append(Turn(action="a", observation="o", reward=1.0))
    return e


def test_rows_hold_the_sampled_ids_with_environment_tokens_masked():
    a = _episode(1, [5, 6, 7], ([10, 11], True), ([20, 21, 22], False), ([12], True))
    b = _episode(2, [8], ([13, 14, 15], True))
    batch = rows([a, b], PAD)
    assert batch.prompt_ids.tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert batch.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.completion_ids.tolist() == [[10, 11, 20, 21, 22, 12], [13, 14, 15, PAD, PAD, PAD]]
    assert batch.completion_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.trained_mask.tolist() == [[1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.loss_mask().tolist() == [[1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0]]
    expected = torch.tensor([[-0.5, -0.6, 0, 0, 0, -0.5], [-0.5, -0.6, -0.7, 0, 0, 0]])
    assert torch.equal(batch.sampler_logp, expected)  # the engine's numbers, copied: exactly equal


def test_without_the_engines_log_probs_the_rows_have_none():
    batch = rows([_episode(1, [5], ([10], True), ([20], False), logp=False)], PAD)
    assert batch.sampler_logp is None


def test_a_turn_sampled_from_other_ids_fails_loudly():
    e = _episode(1, [5, 6], ([10, 11], True), ([20], False))
    e.check_sampled_from([5, 6, 10, 11, 20])
    with pytest.raises(TokenMismatch, match="differ from its 5 at position 2"):
        e.check_sampled_from([5, 6, 9, 11, 20])  # a re-tokenized turn boundary


def test_rows_whose_trained_ids_are_not_the_sampled_ones_are_caught():
    e = _episode(1, [5], ([10, 11], True), ([20], False))
    batch = rows([e], PAD)
    batch.completion_ids[0, 1] = 99
    with pytest.raises(TokenMismatch, match="not the 2 it sampled"):
        check_rows(batch, [e])


def test_the_record_says_which_tokens_each_turn_trained():
    e = _episode(1, [5, 6, 7], ([10, 11], True), ([20, 21, 22], False), ([12], True))
    e.turns.append(Turn(action="b", observation=None, reward=None))
    r = record(e)
    assert r["tokens"] == {"prompt": 3, "sampled": 3, "environment": 3}
    assert [(t["trained_tokens"], t["environment_tokens"]) for t in r["turns"]] == [(2, 3), (1, 0)]
