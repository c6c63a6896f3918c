"""The predicted learning signal of a prompt, against values worked by hand."""

import math

import pytest
import torch

from worker.algos.learnability import beta_moment, group_signal, passes


def test_the_betas_moments_and_a_groups_signal_by_hand():
    # Beta(1, 1): E[p^2] = 1/3, so a pair differs with chance 1 - 1/3 - 1/3; E[p^8] = 1/9
    assert beta_moment(torch.tensor([1.0]), torch.tensor([1.0]), 2).item() == pytest.approx(1 / 3)
    assert group_signal(torch.tensor([1.0]), torch.tensor([1.0]), 8).item() == pytest.approx(1 - 2 / 9)
    # Beta(2, 1): E[p^2] = 2*3 / (3*4) = 1/2, E[(1-p)^2] = 1*2 / (3*4) = 1/6
    assert group_signal(torch.tensor([2.0]), torch.tensor([1.0]), 2).item() == pytest.approx(1 - 1 / 2 - 1 / 6)
    # a prompt seen passing 40 of 40: a group of 4 almost surely ties, E[p^4] = prod (41+i)/(42+i), i < 4
    solved = group_signal(torch.tensor([41.0]), torch.tensor([1.0]), 4).item()
    assert solved == pytest.approx(1 - math.prod((41 + i) / (42 + i) for i in range(4)) - math.prod(
        (1 + i) / (42 + i) for i in range(4)))
    assert solved < 0.1
    # most signal at an even pass rate, the same on either side of it
    even, lopsided = group_signal(torch.tensor([50.0, 80.0]), torch.tensor([50.0, 20.0]), 4).tolist()
    assert even > lopsided and even == pytest.approx(1 - 2 * 0.5**4, abs=0.01)
    assert group_signal(torch.tensor([20.0]), torch.tensor([80.0]), 4).item() == pytest.approx(lopsided)


def test_passes_count_at_the_threshold_and_not_the_unscored():
    counted = passes(torch.tensor([[1.0, 0.5, 0.2, float("nan")], [0.0, 0.0, 1.1, 0.1]]), 0.5)
    assert counted.passed.tolist() == [2.0, 1.0] and counted.failed.tolist() == [1.0, 3.0]
