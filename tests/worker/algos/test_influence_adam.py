"""AdamW-aware influence: D_t against hand-computed values and against torch's own AdamW step."""

import math

import pytest
import torch

from tests.numerics import SEED, assert_close
from tests.worker.algos.test_influence import _batch, _model, _per_sample_losses
from worker.algos.influence import GhostHooks, adam_direction
from worker.algos.lora import lora_layers

BETAS = (0.9, 0.999)


def test_first_step_is_a_sign_step_no_sample_moves():
    # t = 1, no moments: m_hat = gbar, v_hat = gbar^2, u = |gbar| + eps, so
    # D_1 = 1/u - gbar^2 / (|gbar| u^2) = eps / u^2: 1e-8 / 0.25 = 4e-8 and 1e-8 / 4 = 2.5e-9
    gbar = torch.tensor([0.5, -2.0], dtype=torch.float64)
    d = adam_direction(torch.ones(2), gbar, None, None, step=1, betas=BETAS, eps=1e-8)
    # D_1 is the difference of two terms of order 1/|gbar| = 2 that cancel: judged on their scale
    assert_close(d, torch.tensor([1e-8 / (0.5 + 1e-8) ** 2, 1e-8 / (2.0 + 1e-8) ** 2], dtype=torch.float64), scale=2.0)
    # the LESS preconditioner keeps only a_1 / u = 1 / |gbar|
    fixed = adam_direction(torch.ones(2), gbar, None, None, step=1, betas=BETAS, eps=1e-8, moments="fixed")
    assert_close(fixed, torch.tensor([1 / (0.5 + 1e-8), 1 / (2.0 + 1e-8)], dtype=torch.float64))


def test_second_step_by_hand():
    # two parameters after one step; eps = 0.01 so it matters.  t = 2:
    #   c1 = 1 - 0.81 = 0.19, c2 = 1 - 0.998001 = 0.001999, a_2 = 0.1/0.19, b_2 = 0.001/0.001999
    #   p0: m = 0.1, v = 0.001, gbar = 1.0 -> m_hat = (0.09 + 0.1)/0.19 = 1, v_hat = (0.000999 + 0.001)/0.001999 = 1
    #       u = 1.01, D = a_2/1.01 - b_2 * 1 * 1 / (1 * 1.01^2)
    #   p1: m = -0.2, v = 0.004, gbar = 0 -> m_hat = -0.18/0.19, v_hat = 0.003996/0.001999, D = a_2 / (sqrt(v_hat) + 0.01)
    m, v = torch.tensor([0.1, -0.2]), torch.tensor([0.001, 0.004])
    gbar, g_val = torch.tensor([1.0, 0.0]), torch.tensor([2.0, -3.0])
    a2, b2 = 0.1 / 0.19, 0.001 / 0.001999
    d0 = a2 / 1.01 - b2 / 1.01 ** 2
    d1 = a2 / (math.sqrt(0.003996 / 0.001999) + 0.01)
    out = adam_direction(g_val, gbar, m, v, step=2, betas=BETAS, eps=0.01)
    # m, v, gbar enter as float32 inputs (0.1 is not exact in float32): a float32 input's rounding
    assert_close(out, torch.tensor([2.0 * d0, -3.0 * d1], dtype=torch.float64), dtype=torch.float32, terms=8)


def test_prior_moments_are_the_fixed_ones_with_gbar_squared_at_its_running_estimate():
    # t = 3 after two steps: v = 0.004, V = v / (1 - b2^2) = 0.004 / 0.001999; with eps = 0.01,
    #   D = a_3 / (sqrt(V) + eps), a_3 = 0.1 / (1 - 0.9^3) = 0.1 / 0.271, whatever the batch's gradient
    m, v, g_val = torch.tensor([0.1, -0.2], dtype=torch.float64), torch.tensor([0.004, 0.0], dtype=torch.float64), \
        torch.tensor([2.0, -3.0], dtype=torch.float64)
    prior = adam_direction(g_val, None, m, v, step=3, betas=BETAS, eps=0.01, moments="prior")
    a3 = 0.1 / 0.271
    assert_close(prior, torch.tensor([2.0 * a3 / (math.sqrt(0.004 / 0.001999) + 0.01), -3.0 * a3 / 0.01],
                                     dtype=torch.float64), terms=8)
    # gbar^2 equal to V leaves v_hat at V: the fixed-moments direction is then the prior one
    gbar = (v / (1 - BETAS[1] ** 2)).sqrt() * torch.tensor([1.0, -1.0], dtype=torch.float64)
    assert_close(adam_direction(g_val, gbar, m, v, step=3, betas=BETAS, eps=0.01, moments="fixed"), prior, terms=8)
    with pytest.raises(ValueError, match="earlier step"):  # no moments yet: a job scores that step with sgd
        adam_direction(g_val, None, None, None, step=1, betas=BETAS, eps=0.01, moments="prior")


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_derivative_of_a_real_adamw_step(weight_decay):
    """-lr * g_i * D_t is d(delta theta)/d w_i of torch's AdamW step, by central differences in float64,
    for a two-parameter model with three samples, after a few steps of history."""
    gen = torch.Generator().manual_seed(SEED)
    lr, eps = 0.05, 1e-3
    g = torch.randn(3, 2, generator=gen, dtype=torch.float64)  # per-sample gradients [N=3, P=2]
    history = torch.randn(4, 2, generator=gen, dtype=torch.float64)  # earlier steps' batch gradients

    def delta(w: torch.Tensor) -> torch.Tensor:
        theta = torch.nn.Parameter(torch.tensor([0.3, -0.7], dtype=torch.float64))
        opt = torch.optim.AdamW([theta], lr=lr, betas=BETAS, eps=eps, weight_decay=weight_decay)
        for h in history:
            theta.grad = h.clone()
            opt.step()
        before = theta.detach().clone()
        theta.grad = (w[:, None] * g).sum(0)
        opt.step()
        return theta.detach() - before

    theta = torch.nn.Parameter(torch.tensor([0.3, -0.7], dtype=torch.float64))
    opt = torch.optim.AdamW([theta], lr=lr, betas=BETAS, eps=eps, weight_decay=weight_decay)
    for h in history:
        theta.grad = h.clone()
        opt.step()
    state = opt.state[theta]
    d = adam_direction(torch.ones(2), g.sum(0), state["exp_avg"], state["exp_avg_sq"], step=int(state["step"]) + 1,
                       betas=BETAS, eps=eps)
    h = 1e-6
    for i in range(3):
        e = torch.zeros(3, dtype=torch.float64)
        e[i] = h
        numeric = (delta(1 + e) - delta(1 - e)) / (2 * h)  # central difference: O(h^2) error
        # the difference of two updated parameters of size ~1, over 2h: its rounding is ~eps * 1 / h (the
        # O(h^2) truncation, ~1e-12, is smaller)
        assert_close(-lr * g[i] * d, numeric, dtype=torch.float64, ulps=8 / h, scale=1.0)


def test_rescore_equals_explicit_per_sample_gradients(tmp_path):
    """GhostHooks.rescore(X) is <grad_i, X> from each sample's own autograd gradient."""
    model, tok = _model(tmp_path)
    model.train()
    train = _batch(tok, ["Question: 1+1?", "Hi", "A much longer sample with padding"])
    val = _batch(tok, ["Question: 2+2?", "ok then"])
    w_train, w_val = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.7, -1.2])
    layers = lora_layers(model)
    params = [p for layer in layers for p in (layer.a.weight, layer.b.weight)]
    gen = torch.Generator().manual_seed(SEED)
    directions = {i: (torch.randn(la.a.weight.shape, generator=gen), torch.randn(la.b.weight.shape, generator=gen))
                  for i, la in enumerate(layers)}
    flat_x = [x for i in range(len(layers)) for x in directions[i]]

    losses = _per_sample_losses(model, *train, w_train)
    expected = torch.stack([sum((a.double() * x.double()).sum() for a, x in
                                zip(torch.autograd.grad(losses[i], params, retain_graph=True), flat_x))
                            for i in range(3)])
    with GhostHooks(model, keep_factors=True) as hooks:
        _per_sample_losses(model, *val, w_val).sum().backward()
        hooks.capture_validation_gradient()
        losses = _per_sample_losses(model, *train, w_train)
        hooks.start_scoring(3, "cpu")
        losses.sum().backward()
        sgd = hooks.scores.clone()
        got = hooks.rescore(directions)
    # float32 per-sample factors contracted with a float64 direction: sums over r*d terms of float32 values
    assert_close(got, expected, dtype=torch.float32, terms=max(p.numel() for p in params))
    assert not torch.equal(sgd, got)
    # G_val is what the prediction check uses: rescoring leaves it alone
    assert all(hooks.val_grads[i][0].shape == layers[i].a.weight.shape for i in range(len(layers)))
    g_val = hooks.val_grads
    for keep in (False, True):  # X known before the backward (tracin.score adam_prior_state): streamed, the same
        for p in params:
            p.grad = None
        with GhostHooks(model, keep_factors=keep) as hooks:
            _per_sample_losses(model, *val, w_val).sum().backward()
            hooks.capture_validation_gradient()
            hooks.start_scoring(3, "cpu", along=directions)  # before the forward: the hooks project in it
            _per_sample_losses(model, *train, w_train).sum().backward()
            assert_close(hooks.scores, expected, dtype=torch.float32, terms=max(p.numel() for p in params))
            assert all(torch.equal(hooks.val_grads[i][0], g_val[i][0]) for i in g_val)


def test_rescore_needs_the_factors(tmp_path):
    model, _ = _model(tmp_path)
    hooks = GhostHooks(model)
    hooks.start_scoring(2, "cpu")
    with pytest.raises(RuntimeError, match="keep_factors"):
        hooks.rescore({})


def _rms_norm_in_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm without its float32 round trip (it rounds float64 activations to ~1e-7)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _losses64(model, ids, mask, pos, weights):
    """_per_sample_losses with its log-softmax in the model's dtype (float64 here), not float32."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:].to(logp.dtype)
    return -(weights[:, None] * logp * m).sum(1) / m.sum(1)


def test_adam_score_predicts_what_dropping_a_sample_does(tmp_path, monkeypatch):
    """On a LoRA model in float64 after a few AdamW steps: redoing the step without sample i changes the
    validation loss by lr * score_i to first order with the adam score, and not with the sgd score."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_float64)  # all maths in float64
    model, tok = _model(tmp_path)
    model.double().eval()
    train = _batch(tok, ["Question: 1+1?", "Hi", "A much longer sample with padding", "7 8 9", "two"])
    val = _batch(tok, ["Question: 2+2?", "ok then"])
    w_train, w_val = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.0], dtype=torch.float64), torch.tensor([0.7, -1.2])
    layers = lora_layers(model)
    params = [p for layer in layers for p in (layer.a.weight, layer.b.weight)]
    lr = 1e-7  # the first order's error grows with lr (L_val's curvature): ~1e-5 relative here, ~1e-4 at 1e-6
    opt = torch.optim.AdamW(params, lr=1e-3, betas=BETAS, eps=1e-8)
    for k in range(3):  # history: the moments of a few earlier steps on reweighted batches
        opt.zero_grad()
        _losses64(model, *train, w_train * (1 + 0.3 * k)).sum().backward()
        opt.step()
    for group in opt.param_groups:
        group["lr"] = lr
    state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    theta = [p.detach().clone() for p in params]

    def val_loss() -> float:
        with torch.no_grad():
            return float(_losses64(model, *val, w_val.double()).sum())

    def step_with(weights: torch.Tensor) -> float:
        """L_val after the AdamW step from the same weights and moments on the reweighted batch."""
        with torch.no_grad():
            for p, t in zip(params, theta):
                p.copy_(t)
        for p in params:
            opt.state[p] = {k: v.clone() for k, v in state[p].items()}
        opt.zero_grad()
        _losses64(model, *train, w_train * weights).sum().backward()
        opt.step()
        return val_loss()

    with GhostHooks(model, keep_factors=True) as hooks:
        opt.zero_grad()
        _losses64(model, *val, w_val.double()).sum().backward()
        hooks.capture_validation_gradient()
        hooks.start_scoring(5, "cpu")
        _losses64(model, *train, w_train).sum().backward()
        sgd = hooks.scores.clone()
        gbar = {p: p.grad.detach().clone() for p in params}
        directions = {i: tuple(adam_direction(g, gbar[p], state[p]["exp_avg"], state[p]["exp_avg_sq"],
                                              step=int(state[p]["step"]) + 1, betas=BETAS, eps=1e-8)
                               for p, g in zip((layer.a.weight, layer.b.weight), hooks.val_grads[i]))
                      for i, layer in enumerate(layers)}
        adam = hooks.rescore(directions).clone()
    eye = torch.eye(5, dtype=torch.float64)
    h = 1e-3  # d L_val / d w_i by central differences of the real step in sample i's weight
    marginal = torch.tensor([(step_with(1 - h * eye[i]) - step_with(1 + h * eye[i])) / (2 * h) for i in range(5)])
    # lowering w_i raises L_val by lr * score_i, to O(h^2) (AdamW is not linear in w_i) and O(lr) (L_val's
    # curvature): seen 1e-5 relative at most, against float64 rounding of ~1e-16 / (2h lr) ~ 1e-6
    assert_close(lr * adam, marginal, dtype=torch.float64, ulps=5e11)  # rtol 1e-4: the first order's own error
    assert (lr * sgd - marginal).abs().max() > 0.5 * marginal.abs().max(), "sgd should not predict an AdamW step"
