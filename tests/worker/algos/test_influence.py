import pytest
import torch

from service.core.specs import LoraSpec, ModelSpec
from tests.numerics import SEED, assert_close
from worker.algos.influence import GhostHooks, influence_scores
from worker.algos.lora import lora_layers
from worker.model.loading import load_policy


def _model(tmp_path, dropout=0.0, targets="all-linear", dtype="float32"):
    spec = ModelSpec(name="tiny-random-llama", dtype=dtype,
                     lora=LoraSpec(r=4, alpha=12, dropout=dropout, target_modules=targets))
    model, tok = load_policy(spec, models_root=tmp_path, device="cpu", seed=0)
    gen = torch.Generator().manual_seed(SEED)  # the same numbers on every run: a failure reproduces
    with torch.no_grad():  # LoRA B starts at zero; give it values so both A and B gradients are non-trivial
        for layer in lora_layers(model):
            layer.b.weight.normal_(0, 0.05, generator=gen)
    return model, tok


def _batch(tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)  # left padding
    pos = (enc["attention_mask"].cumsum(1) - 1).clamp(min=0)
    return enc["input_ids"], enc["attention_mask"], pos


def _per_sample_losses(model, ids, mask, pos, weights):
    """A GRPO-like per-sample loss: weighted mean token log-likelihood over real positions."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:].float()
    return -(weights[:, None] * logp * m).sum(1) / m.sum(1)


def _naive(model, train_fn, val_fn):
    params = [p for layer in lora_layers(model) for p in (layer.a.weight, layer.b.weight)]
    g_val = torch.autograd.grad(val_fn(), params)
    losses = train_fn()
    out = []
    for i in range(losses.shape[0]):
        g_i = torch.autograd.grad(losses[i], params, retain_graph=True)
        out.append(sum((a.double() * b.double()).sum() for a, b in zip(g_i, g_val)))
    return torch.stack(out)


@pytest.mark.parametrize("dropout,targets,dtype", [(0.0, "all-linear", "float32"),
                                                   (0.1, ["q_proj", "v_proj", "down_proj"], "float32"),
                                                   (0.0, "all-linear", "bfloat16")])
def test_scores_equal_naive_per_sample_autograd(tmp_path, dropout, targets, dtype):
    """The hooks' scores are each sample's <grad L_i, G_val>; with bfloat16 base weights (what `model.dtype:
    auto` loads where the device multiplies bfloat16 natively) too, the adapters float32 as their gradients."""
    model, tok = _model(tmp_path, dropout, targets, dtype)
    assert all(p.dtype == torch.float32 for layer in lora_layers(model) for p in (layer.a.weight, layer.b.weight))
    model.train()
    train = _batch(tok, ["Question: 1+1?", "Hi", "A much longer sample with padding", "7 8 9"])
    val = _batch(tok, ["Question: 2+2?", "ok then"])
    w_train = torch.tensor([1.0, -0.5, 2.0, 0.0])  # the last sample has zero advantage
    w_val = torch.tensor([0.7, -1.2])

    def seeded(fn, seed):
        def call():
            torch.manual_seed(seed)  # same dropout masks in both computations
            return fn()
        return call

    train_fn = seeded(lambda: _per_sample_losses(model, *train, w_train), 1)
    val_fn = seeded(lambda: _per_sample_losses(model, *val, w_val).sum(), 2)
    ghost = influence_scores(model, train_fn, val_fn)
    naive = _naive(model, train_fn, val_fn)
    assert ghost.shape == (4,)
    # float32 gradients summed over the batch's tokens in another order (the naive side sums them in float64)
    assert_close(ghost, naive, dtype=torch.float32, terms=train[0].numel())
    assert ghost[3] == 0.0  # zero advantage: zero influence
    assert all(p.grad is None for p in model.parameters())


def test_recovered_subset_gradient_equals_fresh_backward(tmp_path):
    model, tok = _model(tmp_path)
    train = _batch(tok, ["Question: 1+1?", "Hi", "A longer one", "7 8 9", "zz"])
    w = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.0])
    val = _batch(tok, ["Question: 2+2?"])
    with GhostHooks(model, keep_factors=True) as hooks:
        _per_sample_losses(model, *val, torch.tensor([1.0])).sum().backward()
        hooks.capture_validation_gradient()
        hooks.start_scoring(5, "cpu")
        # two micro-batches, as the loop runs them
        for rows in (torch.tensor([0, 1, 2]), torch.tensor([3, 4])):
            hooks.place(rows)
            _per_sample_losses(model, *(t[rows] for t in train), w[rows]).sum().backward()
    subset = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    hooks.fold(subset * 2.5)
    recovered = hooks.subset
    assert not hooks.factors  # folded factors are freed
    model.zero_grad(set_to_none=True)
    keep = subset.bool()
    (2.5 * _per_sample_losses(model, *(t[keep] for t in train), w[keep]).sum()).backward()
    for layer in lora_layers(model):
        for p in (layer.a.weight, layer.b.weight):
            assert_close(recovered[p], p.grad, terms=train[0].numel())  # the same sum over tokens, in another order


def _hooked_train_pass(model, tok, *, fold_each_micro_batch: bool):
    """Validation gradient, then two training micro-batches with kept factors; with
    fold_each_micro_batch, positive-score samples are folded as soon as their micro-batch is done."""
    train = _batch(tok, ["Question: 1+1?", "Hi", "A longer one", "7 8 9", "zz", "Answer: 4"])
    w = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.0, 0.8])
    val = _batch(tok, ["Question: 2+2?", "ok"])
    with GhostHooks(model, keep_factors=True) as hooks:
        _per_sample_losses(model, *val, torch.tensor([1.0, -0.6])).sum().backward()
        hooks.capture_validation_gradient()
        hooks.start_scoring(6, "cpu")
        for rows in (torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])):
            hooks.place(rows)
            _per_sample_losses(model, *(t[rows] for t in train), w[rows]).sum().backward()
            if fold_each_micro_batch:
                hooks.fold((hooks.scores > 0).double())  # rows not yet scored are 0: not folded
                assert not hooks.factors
    if not fold_each_micro_batch:
        hooks.fold((hooks.scores > 0).double())
    model.zero_grad(set_to_none=True)
    return hooks.scores, hooks.subset, (train, w)


def test_factor_scores_equal_naive_and_streamed_fold_equals_batch_fold(tmp_path):
    model, tok = _model(tmp_path)
    streamed_scores, streamed, (train, w) = _hooked_train_pass(model, tok, fold_each_micro_batch=True)
    scores, whole, _ = _hooked_train_pass(model, tok, fold_each_micro_batch=False)
    val = _batch(tok, ["Question: 2+2?", "ok"])
    naive = _naive(model, lambda: _per_sample_losses(model, *train, w),
                   lambda: _per_sample_losses(model, *val, torch.tensor([1.0, -0.6])).sum())
    assert_close(scores, naive, dtype=torch.float32, terms=train[0].numel())  # scores from the kept factors
    torch.testing.assert_close(streamed_scores, scores)
    keep = scores > 0
    assert 0 < int(keep.sum()) < 6, "the batch should have helpful and harmful samples"
    _per_sample_losses(model, *(t[keep] for t in train), w[keep]).sum().backward()
    for layer in lora_layers(model):
        for p in (layer.a.weight, layer.b.weight):
            assert_close(streamed[p], whole[p], terms=train[0].numel())
            assert_close(streamed[p], p.grad, terms=train[0].numel())
