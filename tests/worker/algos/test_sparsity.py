import doctest

import pytest
import torch

from worker.algos import sparsity as sp
from worker.algos.sparsity import (
    component,
    diff_report,
    layer_index,
    logit_agreement,
    random_mask_like,
)


def test_docstrings():
    assert doctest.testmod(sp).failed == 0


def test_unchanged_shares_in_fp32_and_bf16_at_the_literatures_tolerances():
    before = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.001, 0.001, 0.5])
    after = before + torch.tensor([0.0, 2e-6, 3e-5, 2e-3, 1e-2, 3e-6, 2e-4, 0.0])
    r = diff_report([("model.layers.0.mlp.up_proj.weight", before, after)], thresholds=[0.0], rtol=0.0, primary=0.0)
    # fp32: unchanged are the two zeros; within 1e-5 also +2e-6 and +3e-6; within 1e-4 also +3e-5
    assert r.precision.fp32 == {"0.0": 2 / 8, "1e-05": 4 / 8, "0.0001": 5 / 8}
    # bf16 keeps 8 significant bits: near 1 its step is 2^-7, so +2e-6, +3e-5 and +2e-3 round back to 1.0
    # (only +1e-2 reaches the next value, 1 + 2^-7); near 0.001 the step is 2^-17 ~ 7.6e-6, so +3e-6 rounds
    # back and +2e-4 moves 26 steps (1.98e-4): unchanged at every tolerance are 6 of the 8
    assert r.precision.bf16 == {"0.0": 6 / 8, "1e-05": 6 / 8, "0.0001": 6 / 8}
    assert r.per_layer["0"].precision == r.precision  # per layer and component too


def test_task_kl_is_k3_under_the_starting_policys_samples():
    import math

    logp0 = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.2, 0.2, 0.2]]))
    logp = torch.log(torch.tensor([[0.25, 0.25, 0.1], [0.4, 0.2, 0.2]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # the third token of row 0 is padding
    per_completion, per_token = sp.task_kl(logp0, logp, mask)
    k = lambda r: r - 1 - math.log(r)  # noqa: E731  r = pi / pi_0
    row0, row1 = k(0.5) + k(1.0), k(2.0)
    assert per_completion == pytest.approx((row0 + row1) / 2)
    assert per_token == pytest.approx((row0 + row1) / 3)
    assert sp.task_kl(logp0, logp0, mask) == (0.0, 0.0)


def test_known_sparsity_at_each_threshold():
    before = torch.zeros(10)
    after = torch.tensor([0, 0, 0, 0, 1e-9, 1e-9, 1e-7, 1e-5, 1e-3, 1.0])
    r = diff_report([("model.layers.0.mlp.up_proj.weight", before, after)],
                    thresholds=[0.0, 1e-8, 1e-6, 1e-4], rtol=0.0, primary=0.0)
    assert r.sparsity == {"0.0": 0.4, "1e-08": 0.6, "1e-06": 0.7, "0.0001": 0.8}
    assert r.sparsity_primary == 0.4
    assert r.max_abs_change == 1.0
    assert r.mean_abs_change == pytest.approx((2e-9 + 1e-7 + 1e-5 + 1e-3 + 1.0) / 10)


def test_relative_tolerance_and_sign_flips():
    before = torch.tensor([1.0, -2.0, 100.0, 0.5])
    after = torch.tensor([1.0005, 2.0, 100.05, -0.5])
    r = diff_report([("w", before, after)], thresholds=[0.0], rtol=1e-3, primary=0.0)
    assert r.sparsity_rtol == 0.5  # 5e-4 <= 1e-3 * 1 and 0.05 <= 1e-3 * 100
    assert r.sign_flip_ratio == 0.5
    assert r.mean_rel_change == pytest.approx((5e-4 + 2.0 + 5e-4 + 2.0) / 4, rel=1e-4)


@pytest.mark.parametrize("name,layer,comp", [
    ("model.layers.3.self_attn.q_proj.weight", 3, "q_proj"),
    ("model.layers.3.self_attn.q_proj.bias", 3, "q_proj"),  # Qwen2 has q/k/v biases
    ("model.layers.12.mlp.down_proj.weight", 12, "down_proj"),
    ("model.layers.0.post_attention_layernorm.weight", 0, "norms"),
    ("model.norm.weight", None, "norms"),
    ("model.embed_tokens.weight", None, "embeddings"),
    ("lm_head.weight", None, "lm_head"),
    ("base_model.model.model.layers.5.mlp.gate_proj.lora_A.default.weight", 5, "lora_A"),
])
def test_layer_and_component_parsing(name, layer, comp):
    assert layer_index(name) == layer and component(name) == comp


def test_per_layer_and_component_breakdown():
    z = torch.zeros(4)
    pairs = [("model.layers.0.self_attn.q_proj.weight", z, torch.tensor([1.0, 0, 0, 0])),
             ("model.layers.1.self_attn.q_proj.weight", z, z.clone()),
             ("model.layers.1.mlp.up_proj.weight", z, torch.ones(4))]
    r = diff_report(pairs, thresholds=[0.0], rtol=0.0, primary=0.0)
    assert r.per_layer["0"].sparsity["0.0"] == 0.75
    assert r.per_layer["1"].sparsity["0.0"] == 0.5
    assert r.per_component["q_proj"].sparsity["0.0"] == pytest.approx(7 / 8)
    assert r.per_component["up_proj"].numel == 4
    assert r.per_layer_component == {"0": {"q_proj": 0.75}, "1": {"q_proj": 1.0, "up_proj": 0.0}}


def test_float32_diff_catches_what_bf16_storage_hides():
    before = torch.ones(1000)
    after = before + 1e-4  # below bf16 spacing at 1.0 (2**-7)
    f32 = diff_report([("w", before, after)], thresholds=[0.0], rtol=0.0, primary=0.0)
    bf16 = diff_report([("w", before.bfloat16(), after.bfloat16())], thresholds=[0.0], rtol=0.0, primary=0.0)
    assert f32.sparsity_primary == 0.0 and bf16.sparsity_primary == 1.0


def test_random_mask_has_the_same_density():
    mask = torch.rand(50, 40) > 0.7
    r = random_mask_like(mask, torch.Generator().manual_seed(0))
    assert r.sum() == mask.sum() and r.shape == mask.shape and not torch.equal(r, mask)


def test_logit_agreement_identity_and_difference():
    full = torch.randn(2, 3, 7)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    same = logit_agreement(full, full.clone(), mask)
    assert same.kl == pytest.approx(0.0, abs=1e-7) and same.top1_agreement == 1.0
    assert same.cosine == pytest.approx(1.0) and same.mse == 0.0
    assert logit_agreement(full, -full, mask).top1_agreement < 1.0
