import math

import pytest
import torch

from tests.numerics import approx, assert_close
from worker.algos.losses import (
    Normaliser,
    aggregate,
    k3_kl,
    masked_mean,
    policy_loss,
    sample_losses,
)


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_ratio_one_is_reinforce_with_baseline():
    logp = _t([[-1.0, -2.0], [-0.5, -0.3]])
    adv = _t([2.0, -1.0])
    mask = _t([[1, 1], [1, 0]])
    loss, st = policy_loss(logp, logp.clone(), adv, mask)
    # ratio 1 everywhere: per-token loss = -A; token mean over 3 tokens = -(2 + 2 - 1) / 3
    assert loss.item() == pytest.approx(-1.0)
    assert st["ratio/mean"] == pytest.approx(1.0)
    assert st["clip_ratio/region_mean"] == 0.0


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
    assert st["clip_ratio/region_mean"] == pytest.approx(0.25)
    # negative advantage: min(-r, -clip(r)) -> the lower clip binds for r=0.61
    loss_neg, st = policy_loss(logp, old, _t([-1.0]), mask)
    expected = (r[0] + 0.8 + r[2] + r[3]) / 4
    assert loss_neg.item() == pytest.approx(expected.item(), rel=1e-6)
    assert st["clip_ratio/region_mean"] == pytest.approx(0.25)


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
    assert st["kl"] == pytest.approx((math.exp(d) - d - 1) / 2)


def test_masked_positions_do_not_count():
    logp = _t([[-1.0, 50.0]])  # a huge masked value must not leak into loss or stats
    loss, st = policy_loss(logp, _t([[-1.0, 0.0]]), _t([1.0]), _t([[1, 0]]))
    assert loss.item() == pytest.approx(-1.0)
    assert st["ratio/max"] == pytest.approx(1.0)


def test_masked_mean_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0


def test_entropy_matches_definition():
    from worker.algos.losses import entropy_from_logits

    logits = torch.randn(3, 5, 11)
    p = torch.softmax(logits, -1)
    assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1), terms=logits.shape[-1])


# -- one definition: per-sample shares add up to the batch loss -------------------------------------
# Two sequences, T = 3: lengths 3 and 1. Ratio 1 (old = logp), so each token's surrogate is -A.
LOGP = [[-1.0, -2.0, -0.5], [-0.7, 0.0, 0.0]]
REF = [[-1.0, -1.5, -0.5], [-0.2, 0.0, 0.0]]  # d = ref - logp: 0, 0.5, 0 | 0.5
MASK = [[1, 1, 1], [1, 0, 0]]
ADV = [1.0, -2.0]
K = math.exp(0.5) - 0.5 - 1.0  # k3 at d = 0.5
# token sums per sequence: surrogate -3*1 = -3 and +2*1 = 2; KL K and K
EXPECTED = {  # agg -> (surrogate shares, KL shares), by hand
    "token_mean": ([-3 / 4, 2 / 4], [K / 4, K / 4]),
    "seq_mean": ([-3 / 3 / 2, 2 / 1 / 2], [K / 3 / 2, K / 1 / 2]),
    "dr_grpo": ([-3 / 6, 2 / 6], [K / 6, K / 6]),
}


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "dr_grpo"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_sample_shares_are_hand_computed_and_sum_to_the_batch_loss(agg, kl_coef):
    logp, mask = _t(LOGP), _t(MASK)
    ref = _t(REF) if kl_coef else None
    parts = sample_losses(logp, logp.clone(), _t(ADV), mask, Normaliser.of(mask, agg), ref_logp=ref, kl_coef=kl_coef)
    pol, kl = EXPECTED[agg]
    torch.testing.assert_close(parts.policy, _t(pol))
    expected = [p + kl_coef * k for p, k in zip(pol, kl)] if kl_coef else pol
    torch.testing.assert_close(parts.loss.detach(), _t(expected))
    loss, st = policy_loss(logp, logp.clone(), _t(ADV), mask, ref_logp=ref, kl_coef=kl_coef, agg=agg)
    assert loss.item() == pytest.approx(sum(expected))
    assert st["loss/policy"] == pytest.approx(sum(pol))
    if kl_coef:
        torch.testing.assert_close(parts.kl, _t(kl))
        assert st["kl"] == pytest.approx(sum(kl))
    else:  # no reference: KL is not measured, and not reported as a made-up 0
        assert parts.kl is None and "kl" not in st


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "dr_grpo"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_micro_batch_accumulation_equals_the_whole_batch(agg, kl_coef):
    torch.manual_seed(0)
    B, T = 5, 7
    base = torch.randn(B, T)
    old = base + 0.3 * torch.randn(B, T)  # ratios away from 1, some clipped
    ref = base + 0.2 * torch.randn(B, T)
    adv = torch.randn(B)
    mask = (torch.arange(T)[None, :] < torch.tensor([7, 3, 5, 1, 6])[:, None]).float()
    kw = dict(ref_logp=ref, kl_coef=kl_coef, clip_eps_low=0.2, clip_eps_high=0.28)

    whole = base.clone().requires_grad_(True)
    loss, st = policy_loss(whole, old, adv, mask, agg=agg, **kw)
    loss.backward()

    split = base.clone().requires_grad_(True)
    norm = Normaliser.of(mask, agg)  # the whole batch's, for every micro-batch
    total, policy = 0.0, 0.0
    for rows in ([0, 1], [2, 3], [4]):
        parts = sample_losses(split[rows], old[rows], adv[rows], mask[rows], norm,
                              ref_logp=ref[rows], kl_coef=kl_coef, clip_eps_low=0.2, clip_eps_high=0.28)
        parts.loss.sum().backward()
        total += float(parts.loss.detach().sum())
        policy += float(parts.policy.sum())
    # the same B * T terms summed in another grouping
    assert total == approx(loss.item(), terms=B * T)
    assert policy == approx(st["loss/policy"], terms=B * T)
    assert_close(split.grad, whole.grad, terms=B * T)


def test_unknown_aggregation_is_named():
    with pytest.raises(ValueError, match="nope"):
        Normaliser.of(torch.ones(1, 1), "nope")


def test_gspo_uses_the_length_normalised_sequence_ratio():
    old = torch.zeros(2, 3)
    logp = _t([[0.3, -0.1, 0.0], [0.05, 0.05, 9.0]])
    mask = _t([[1, 1, 1], [1, 1, 0]])
    adv = _t([1.0, -1.0])
    # sequence 0: s = exp((0.3 - 0.1 + 0) / 3) = exp(0.0667) = 1.069 (inside [0.8, 1.2]): -1.069 on 3 tokens
    # sequence 1: s = exp(0.05) = 1.051, A < 0: -min(-1.051, -1.051) = 1.051 on 2 tokens (the padded 9.0 is ignored)
    s0, s1 = math.exp(0.2 / 3), math.exp(0.05)
    loss, st = policy_loss(logp, old, adv, mask, loss="gspo", agg="seq_mean")
    assert loss.item() == approx((-s0 + s1) / 2, terms=3)
    loss, st = policy_loss(logp, old, adv, mask, loss="gspo", agg="token_mean")
    assert loss.item() == approx((-3 * s0 + 2 * s1) / 5, terms=5)
    assert st["ratio/mean"] == approx((3 * s0 + 2 * s1) / 5, terms=5)
    assert st["clip_ratio/region_mean"] == 0.0


def test_gspo_clips_the_whole_sequence_and_its_gradient_is_the_mean_token_gradient():
    old = torch.zeros(1, 2)
    logp = _t([[0.5, 0.3]]).requires_grad_()  # s = exp(0.4) = 1.49 > 1.2 with A > 0: clipped, no gradient
    loss, st = policy_loss(logp, old, _t([1.0]), torch.ones(1, 2), loss="gspo")
    assert loss.item() == pytest.approx(-1.2)
    assert st["clip_ratio/region_mean"] == 1.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))
    logp = _t([[0.1, -0.1]]).requires_grad_()  # s = 1: d(-s A)/d logp_t = -A s / |y| = -0.5 per token
    policy_loss(logp, old, _t([1.0]), torch.ones(1, 2), loss="gspo", agg="seq_mean")[0].backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.5, -0.5])


def test_cispo_weights_are_clipped_and_carry_no_gradient():
    old = torch.zeros(1, 3)
    logp = _t([[0.5, -0.5, 0.1]]).requires_grad_()  # ratios 1.65, 0.61, 1.105
    adv = _t([2.0])
    loss, st = policy_loss(logp, old, adv, torch.ones(1, 3), loss="cispo")
    w = [1.2, 0.8, math.exp(0.1)]  # clip(r, 0.8, 1.2)
    # -sg(w) A logp, token mean
    assert loss.item() == approx(-sum(wi * 2.0 * li for wi, li in zip(w, [0.5, -0.5, 0.1])) / 3, terms=3)
    assert st["clip_ratio/region_mean"] == pytest.approx(2 / 3)
    loss.backward()
    # clipped tokens still train: d/dlogp_t = -w_t A / 3 for every token
    assert logp.grad[0].tolist() == approx([-wi * 2.0 / 3 for wi in w])


@pytest.mark.parametrize("variant", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "dr_grpo"])
def test_every_variant_splits_into_samples_that_add_up(variant, agg):
    torch.manual_seed(0)
    logp = torch.randn(5, 4) * 0.1 - 1.0
    old = logp + torch.randn(5, 4) * 0.05
    mask = (torch.rand(5, 4) > 0.3).float()
    mask[:, 0] = 1
    adv, w = torch.randn(5), torch.rand(5, 4) + 0.5
    loss, _ = policy_loss(logp, old, adv, mask, agg=agg, loss=variant, weights=w)
    norm = Normaliser.of(mask, agg)
    parts = [sample_losses(logp[r], old[r], adv[r], mask[r], norm, loss=variant, weights=w[r]).loss.sum()
             for r in ([0, 3], [1, 2, 4])]
    assert float(sum(parts)) == approx(float(loss), terms=logp.numel())


def test_weights_multiply_each_tokens_surrogate():
    logp = torch.zeros(1, 2)
    loss, _ = policy_loss(logp, logp, _t([1.0]), torch.ones(1, 2), weights=_t([[0.5, 2.0]]))
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
