import itertools
import math

import pytest
import torch

from worker.algos.retrieval import (
    categorical_entropy,
    categorical_kl,
    retriever_loss,
    sample_without_replacement,
    sequential_logprobs,
)


def _brute_force(logits, k):
    """Probability of every ordered k-draw without replacement, by enumeration."""
    p = torch.softmax(logits.double(), -1)
    out = {}
    for draw in itertools.permutations(range(len(logits)), k):
        prob, left = 1.0, 1.0
        for i in draw:
            prob *= p[i].item() / left
            left -= p[i].item()
        out[draw] = prob
    return out


def test_sequential_logprobs_match_enumeration():
    logits = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7], dtype=torch.float64)
    table = _brute_force(logits, 3)
    assert sum(table.values()) == pytest.approx(1.0)
    for draw, prob in list(table.items())[::7]:
        lp = sequential_logprobs(logits, torch.tensor(draw)).sum().item()
        assert lp == pytest.approx(math.log(prob), rel=1e-10)


def test_gumbel_top_k_samples_the_plackett_luce_distribution():
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5])
    table = _brute_force(logits, 2)
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = {}
    for _ in range(n):
        d = tuple(sample_without_replacement(logits, 2, g).tolist())
        counts[d] = counts.get(d, 0) + 1
    for draw, prob in table.items():
        assert counts.get(draw, 0) / n == pytest.approx(prob, abs=0.015)


def test_retriever_loss_hand_computed():
    old = torch.log(torch.tensor([0.5, 0.25]))
    logp = old + torch.tensor([math.log(1.5), math.log(0.9)])  # ratios 1.5 (clipped to 1.2), 0.9
    adv = torch.tensor([1.0, -1.0])
    loss, st = retriever_loss(logp, old, adv, clip_eps=0.2)
    # doc 0: min(1.5, 1.2) * 1 = 1.2; doc 1: min(-0.9, -0.9) = -0.9; loss = -(1.2 - 0.9) / 2
    assert loss.item() == pytest.approx(-0.15)
    logits, ref = torch.tensor([1.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 0.0])
    loss_kl, st = retriever_loss(logp, old, adv, clip_eps=0.2, logits=logits, ref_logits=ref, kl_coef=0.5)
    p = torch.softmax(logits, -1)
    kl = (p * (p.log() - math.log(1 / 3))).sum().item()
    assert st["retriever/kl"].item() == pytest.approx(kl, rel=1e-5)
    assert loss_kl.item() == pytest.approx(-0.15 + 0.5 * kl, rel=1e-5)


def test_kl_and_entropy_edge_cases():
    x = torch.tensor([0.2, 1.0, -3.0])
    assert categorical_kl(x, x).item() == pytest.approx(0.0, abs=1e-7)
    assert categorical_entropy(torch.zeros(4)).item() == pytest.approx(math.log(4))
