import torch

from worker.algos import selection as sel


def test_positive_and_top_fraction():
    s = torch.tensor([0.5, -1.0, 0.0, 2.0, 0.1])
    assert sel.positive(s).tolist() == [True, False, False, True, True]
    assert sel.top_fraction(s, 0.4).tolist() == [True, False, False, True, False]
    assert sel.top_fraction(s, 0.01).sum() == 1


def test_random_subset_size_and_seed():
    a = sel.random_subset(10, 0.3, torch.Generator().manual_seed(1))
    b = sel.random_subset(10, 0.3, torch.Generator().manual_seed(1))
    assert a.sum() == 3 and torch.equal(a, b)


def test_greedy_avoids_redundant_samples():
    # samples 0 and 1 have the same gradient direction; 2 is orthogonal with a lower score
    scores = torch.tensor([1.0, 0.99, 0.8], dtype=torch.float64)
    gram = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    assert sel.greedy(scores, gram, fraction=2 / 3, eta=0.5).tolist() == [True, False, True]
    assert sel.top_fraction(scores, 2 / 3).tolist() == [True, True, False]
    # a gain that turns non-positive stops the selection early
    assert sel.greedy(torch.tensor([1.0, 0.4], dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64),
                      fraction=1.0, eta=1.0).tolist() == [True, False]


def test_histogram_counts_everything():
    h = sel.histogram(torch.tensor([0.0, 1.0, 1.0, 2.0]), bins=4)
    assert sum(h["counts"]) == 4 and len(h["edges"]) == 5
    assert sum(sel.histogram(torch.zeros(3))["counts"]) == 3


def test_top_cosine_ranks_by_direction_not_length():
    # sample 0 has the largest inner product only because its gradient is long
    scores = torch.tensor([4.0, 2.0, 1.0, -1.0], dtype=torch.float64)
    sq_norms = torch.tensor([100.0, 1.0, 1.0, 1.0], dtype=torch.float64)  # cosines ∝ 0.4, 2, 1, -1
    assert sel.top_cosine(scores, sq_norms, 0.5).tolist() == [False, True, True, False]
    assert sel.top_fraction(scores, 0.5).tolist() == [True, True, False, False]
    # a zero gradient has cosine 0, not nan
    assert sel.top_cosine(torch.tensor([0.0, -1.0]), torch.tensor([0.0, 1.0]), 0.5).tolist() == [True, False]


def test_pass_rate_keeps_whole_groups_nearest_half_correct():
    # groups of 4: pass rates 1.0, 0.5, 0.25, 0.0
    correct = torch.tensor([1, 1, 1, 1, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    assert sel.pass_rate(correct, 4, 0.25).tolist() == [False] * 4 + [True] * 4 + [False] * 8
    # half the samples: the 0.5 group, then the 0.25 group (0.25 from 50%, before 1.0 and 0.0)
    assert sel.pass_rate(correct, 4, 0.5).tolist() == [False] * 4 + [True] * 8 + [False] * 4
    # a fraction that ends inside a group keeps the whole group
    assert int(sel.pass_rate(correct, 4, 0.3).sum()) == 8
