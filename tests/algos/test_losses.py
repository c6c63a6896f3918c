import math

import pytest
import torch

from worker.algos.losses import aggregate, k3_kl, masked_mean, policy_loss


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_ratio_one_is_reinforce_with_baseline():
    logp = _t([[-1.0, -2.0], [-0.5, -0.3]])
    adv = _t([2.0, -1.0])
    mask = _t([[1, 1], [1, 0]])
    loss, st = policy_loss(logp, logp.clone(), adv, mask)
    # ratio 1 everywhere: per-token loss = -A; token mean over 3 tokens = -(2 + 2 - 1) / 3
    assert loss.item() == pytest.approx(-1.0)
    assert st["ratio/mean"].item() == pytest.approx(1.0)
    assert st["clip_ratio/region_mean"].item() == 0.0


def test_clipped_and_unclipped_branches():
    old = _t([[0.0, 0.0, 0.0, 0.0]])
    # ratios e^0.5=1.6487 (above 1.2), e^-0.5=0.6065 (below 0.8), e^0.1=1.105, e^-0.1=0.905 (inside)
    logp = _t([[0.5, -0.5, 0.1, -0.1]])
    mask = torch.ones(1, 4)
    r = torch.exp(logp)[0]
    # positive advantage: min(r, clip(r)) -> the upper clip binds for r=1.65, not for r=0.61
    loss_pos, st = policy_loss(logp, old, _t([1.0]), mask)
    expected = -(1.2 + r[1] + r[2] + r[3]) / 4
    assert loss_pos.item() == pytest.approx(expected.item(), rel=1e-6)
    assert st["clip_ratio/region_mean"].item() == pytest.approx(0.25)
    # negative advantage: min(-r, -clip(r)) -> the lower clip binds for r=0.61
    loss_neg, st = policy_loss(logp, old, _t([-1.0]), mask)
    expected = (r[0] + 0.8 + r[2] + r[3]) / 4
    assert loss_neg.item() == pytest.approx(expected.item(), rel=1e-6)
    assert st["clip_ratio/region_mean"].item() == pytest.approx(0.25)


def test_asymmetric_clip_higher():
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(1.25))  # ratio 1.25
    loss, _ = policy_loss(logp, old, _t([1.0]), torch.ones(1, 1), clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.25)  # inside [0.8, 1.28]: not clipped
    loss, _ = policy_loss(logp, old, _t([1.0]), torch.ones(1, 1), clip_eps_low=0.2, clip_eps_high=0.2)
    assert loss.item() == pytest.approx(-1.2)


def test_clipped_branch_has_no_gradient():
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), 0.5, requires_grad=True)  # ratio 1.65 > 1.2 with A > 0: clipped
    loss, _ = policy_loss(logp, old, _t([1.0]), torch.ones(1, 1))
    loss.backward()
    assert logp.grad.item() == 0.0


def test_aggregations():
    x = _t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = _t([[1, 1, 1], [1, 0, 0]])
    assert aggregate(x, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(x, mask, "seq_mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(x, mask, "dr_grpo").item() == pytest.approx(10 / 6)
    with pytest.raises(ValueError):
        aggregate(x, mask, "nope")


def test_k3_kl_values():
    logp = _t([[-1.0, -2.0]])
    ref = _t([[-1.0, -1.5]])
    kl = k3_kl(logp, ref)
    d = 0.5
    assert kl[0, 0].item() == 0.0
    assert kl[0, 1].item() == pytest.approx(math.exp(d) - d - 1)
    # added to the loss with its coefficient
    loss0, _ = policy_loss(logp, logp, _t([0.0]), torch.ones(1, 2))
    loss1, st = policy_loss(logp, logp, _t([0.0]), torch.ones(1, 2), ref_logp=ref, kl_coef=0.1)
    assert (loss1 - loss0).item() == pytest.approx(0.1 * (math.exp(d) - d - 1) / 2)
    assert st["kl"].item() == pytest.approx((math.exp(d) - d - 1) / 2)


def test_masked_positions_do_not_count():
    logp = _t([[-1.0, 50.0]])  # a huge masked value must not leak into loss or stats
    loss, st = policy_loss(logp, _t([[-1.0, 0.0]]), _t([1.0]), _t([[1, 0]]))
    assert loss.item() == pytest.approx(-1.0)
    assert st["ratio/max"].item() == pytest.approx(1.0)


def test_masked_mean_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0


def test_entropy_matches_definition():
    from worker.algos.losses import entropy_from_logits

    logits = torch.randn(3, 5, 11)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
