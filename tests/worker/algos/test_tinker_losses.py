"""The tinker SDK's built-in losses on hand-computed tensors: value and gradient per token."""

import math

import pytest
import torch

from worker.algos import tinker_losses as L


def leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def value_and_grad(loss: torch.Tensor, logp: torch.Tensor) -> tuple[float, list[float]]:
    loss.backward()
    return loss.item(), logp.grad.tolist()


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_cross_entropy_sums_weighted_negative_logprobs():
    logp = leaf(-1.0, -2.0, -0.5)
    value, grad = value_and_grad(L.cross_entropy(logp, weights=t(0, 1, 1)), logp)
    assert value == pytest.approx(2.5)  # the prompt token (weight 0) adds nothing
    assert grad == pytest.approx([0.0, -1.0, -1.0])


def test_importance_sampling_is_reinforce_at_ratio_one():
    logp = leaf(-1.0, -2.0)
    value, grad = value_and_grad(L.importance_sampling(logp, q=t(-1.0, -2.0), adv=t(2.0, -1.0)), logp)
    assert value == pytest.approx(-1.0)  # -(1*2 + 1*(-1))
    assert grad == pytest.approx([-2.0, 1.0])  # d/dlogp of -r*A = -r*A


def test_ppo_clips_the_ratio_per_token():
    # r = 1.5 (A > 0: clipped to 1.2, no gradient), r = 0.5 (A < 0: clipped to 0.8, no gradient),
    # r = 1.1 (inside the band: -r*A)
    logp = leaf(math.log(1.5), math.log(0.5), math.log(1.1))
    loss = L.ppo(logp, q=t(0, 0, 0), adv=t(1, -1, 1), clip_low=0.8, clip_high=1.2)
    value, grad = value_and_grad(loss, logp)
    assert value == pytest.approx(-(1.2 - 0.8 + 1.1))
    assert grad == pytest.approx([0.0, 0.0, -1.1])


def test_cispo_weighs_every_token_with_its_clipped_ratio():
    logp = leaf(math.log(1.5), math.log(0.5), math.log(1.1))
    loss = L.cispo(logp, q=t(0, 0, 0), adv=t(1, -1, 1), clip_low=0.8, clip_high=1.2)
    value, grad = value_and_grad(loss, logp)
    assert value == pytest.approx(-(1.2 * math.log(1.5) + 0.8 * math.log(0.5) * -1 + 1.1 * math.log(1.1)))
    assert grad == pytest.approx([-1.2, 0.8, -1.1])  # clipped tokens keep a gradient, scaled by the clip


def test_dro_pulls_towards_the_sampler_quadratically():
    logp = leaf(-1.0)
    value, grad = value_and_grad(L.dro(logp, q=t(-1.5), adv=t(2.0), beta=0.5), logp)
    assert value == pytest.approx(-(-1.0 * 2.0 - 0.5 * 0.5 * 0.25))  # 2.0625
    assert grad == pytest.approx([-(2.0 - 0.5 * 0.5)])


@pytest.mark.parametrize("clip_high,expected_value,expected_grad", [
    (1.2, -2.4, [0.0, 0.0]),  # s = sqrt(2) is clipped for both tokens
    (2.0, -2 * math.sqrt(2), [-math.sqrt(2), -math.sqrt(2)]),  # inside: each token's gradient is -s*A
])
def test_gspo_gives_every_token_the_sequence_ratio(clip_high, expected_value, expected_grad):
    logp = leaf(math.log(2.0), 0.0)  # log-ratios ln 2 and 0: s = exp(ln2 / 2) = sqrt(2)
    loss = L.gspo(logp, q=t(0, 0), adv=t(1, 1), clip_low=0.8, clip_high=clip_high)
    value, grad = value_and_grad(loss, logp)
    assert value == pytest.approx(expected_value)
    assert grad == pytest.approx(expected_grad)


def test_gspo_sequence_mask_chooses_the_tokens_of_the_ratio():
    logp = leaf(math.log(2.0), 0.0)
    loss = L.gspo(logp, q=t(0, 0), adv=t(1, 1), clip_low=0.8, clip_high=3.0, sequence_mask=t(1, 0))
    value, grad = value_and_grad(loss, logp)  # s = exp(ln 2) = 2 from the first token alone
    assert value == pytest.approx(-4.0)
    assert grad == pytest.approx([-2.0, -2.0])
