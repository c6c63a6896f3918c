"""The inverse-CDF draw on hand-computed intervals."""

import torch

from worker.algos.draws import inverse_cdf, uniforms


def test_each_uniform_lands_in_its_tokens_interval():
    # dyadic values, exact in binary: the boundaries are where the arithmetic puts them
    probs = torch.tensor([[0.25, 0.0, 0.5, 0.25],  # intervals [0, .25) [.25, .25) [.25, .75) [.75, 1)
                          [1.0, 3.0, 0.0, 0.0]])  # unnormalised, total 4: [0, .25) [.25, 1) then empty
    cases = [(0.0, 0.0), (0.24, 0.24), (0.25, 0.25), (0.74, 0.99), (0.75, 0.5)]
    want = [(0, 0), (0, 0), (2, 1), (2, 1), (3, 1)]
    for (a, b), expected in zip(cases, want, strict=True):
        got = inverse_cdf(probs, torch.tensor([a, b], dtype=torch.float64))
        assert got.tolist() == list(expected), (a, b, got)


def test_a_token_of_probability_zero_is_never_drawn_even_at_the_top_of_the_interval():
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    # the largest double below 1: u * total may round up to the total, which would fall past token 1
    u = torch.tensor([torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))])
    assert inverse_cdf(probs, u).tolist() == [1]
    assert inverse_cdf(probs * 3, u).tolist() == [1]


def test_a_rows_uniforms_come_from_its_own_generator():
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 1)]
    u = uniforms(gens, "cpu")  # [3]
    assert u.dtype == torch.float64 and u.shape == (3,)
    assert u[0] == u[2] != u[1]
    assert u[0] == torch.rand(1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)[0]


def test_draws_follow_the_distribution():
    """20,000 draws of a 5-token distribution with a near-zero token: every frequency within four
    standard errors of its probability."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05 - 1e-9, 1e-9], dtype=torch.float64)
    n = 20_000
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    picks = inverse_cdf(p.expand(n, -1).float(), u)  # float32 probabilities, summed in float64
    freq = torch.bincount(picks, minlength=5).double() / n
    se = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 4 * se + 1e-9).all(), freq
