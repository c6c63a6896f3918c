import pytest
import torch

from tests.numerics import assert_close
from worker.algos.advantages import group_advantages, zero_std_groups


def test_hand_computed_normalised():
    # group 0: [1, 0, 0, 1] mean 0.5, std (Bessel) = sqrt(1/3); group 1: [2, 4, 6, 8] mean 5, std = sqrt(20/3)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])
    a = group_advantages(r, 4, normalize=True, eps=0.0)
    s0, s1 = (1 / 3) ** 0.5, (20 / 3) ** 0.5
    expected = torch.tensor([0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -3 / s1, -1 / s1, 1 / s1, 3 / s1])
    torch.testing.assert_close(a, expected)


def test_eps_in_denominator_and_unnormalised():
    r = torch.tensor([0.0, 2.0])
    # std of [0, 2] is sqrt(2); eps is added to it
    torch.testing.assert_close(group_advantages(r, 2, eps=0.1), torch.tensor([-1.0, 1.0]) / (2**0.5 + 0.1))
    torch.testing.assert_close(group_advantages(r, 2, normalize=False), torch.tensor([-1.0, 1.0]))


def test_zero_std_group_has_zero_advantage():
    r = torch.tensor([3.0, 3.0, 3.0, 0.0, 1.0, 0.0])
    a = group_advantages(r, 3)
    assert torch.equal(a[:3], torch.zeros(3))
    assert zero_std_groups(r, 3).tolist() == [True, False]


def test_groups_are_centred():
    a = group_advantages(torch.rand(5 * 8), 8).view(5, 8)
    assert_close(a.mean(1), torch.zeros(5), terms=8, scale=float(a.abs().max()))  # a mean of 8 values of order 1


@pytest.mark.parametrize("n,g", [(7, 2), (4, 1)])
def test_rejects_bad_shapes(n, g):
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(n), g)
