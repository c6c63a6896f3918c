from worker.session.run import length_groups


def test_length_groups_group_shortest_first_within_the_token_budget():
    lengths = [7, 3, 12, 5, 3, 40]
    groups = length_groups(lengths, max_tokens=16)
    # 3, 3, 5 pad to 5 (15 tokens); 7 and 12 pad to 12 (24 > 16) so split; 40 exceeds the budget alone
    assert groups == [[1, 4, 3], [0], [2], [5]]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert length_groups([4] * 8, max_tokens=16) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert length_groups([], max_tokens=16) == []


class _Reporter:
    """What an optim_step reports: its metrics and progress."""

    def __init__(self):
        self.metrics_seen: list[dict] = []

    def metrics(self, step, metrics):
        self.metrics_seen.append(metrics)

    def progress(self, step):
        pass


def _session(models_root):
    import torch

    from service.core.specs import LoraSpec, ModelSpec
    from worker.model.loading import load_policy
    from worker.session.state import Session

    model, tok = load_policy(ModelSpec(name="tiny-random-llama", dtype="float32", lora=LoraSpec(r=4, dropout=0.0)),
                             models_root=models_root, device="cpu", seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    return Session(model=model, tokenizer=tok, optimizer=torch.optim.AdamW(params), params=params,
                   vocab_size=model.get_input_embeddings().num_embeddings)


def test_an_optim_step_takes_the_apis_adam_defaults_and_refuses_a_non_finite_gradient(models_root):
    import pytest
    import torch

    from service.core.tinker.requests import AdamParamsIn, OptimStepIn
    from service.core.tinker.wire import WireError
    from worker.session.run import optim_step

    s = _session(models_root)
    for p in s.params:
        p.grad = torch.ones_like(p)
    body = OptimStepIn(model_id="m", adam_params=AdamParamsIn(learning_rate=1e-3)).model_dump_json().encode()
    optim_step(s, body, _Reporter())
    defaults = AdamParamsIn(learning_rate=1e-3)  # the one definition of the defaults, the API's
    group = s.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
        (1e-3, (defaults.beta1, defaults.beta2), defaults.eps, defaults.weight_decay)
    assert s.step == 1 and all(p.grad is None for p in s.params)

    before = [p.detach().clone() for p in s.params]
    for p in s.params:
        p.grad = torch.full_like(p, float("nan"))
    s.pending = {"loss": 1.0, "tokens": 3.0}
    with pytest.raises(WireError, match="nothing was applied"):
        optim_step(s, body, _Reporter())
    assert all(torch.equal(a, p) for a, p in zip(before, s.params))  # the weights as they were
    assert all(p.grad is None for p in s.params) and s.pending == {"loss": 0.0, "tokens": 0.0} and s.step == 1
