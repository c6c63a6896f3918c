"""The sampler's folded copy of the adapted weights: the same model as the rollout copy's LoRA layers, up to
rounding, refolded at each sync, sharing every other weight, in the weights' own dtype."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from service.core.specs import LoraSpec, ModelSpec
from tests.numerics import assert_close
from worker.algos.lora import lora_layers
from worker.batch import SamplingParams
from worker.engines.folded import FoldedSampler, adapted_bytes, foldable
from worker.engines.hf_engine import HFEngine
from worker.machine.memory import GB, plan_fold
from worker.model.loading import load_policy


def _policy(tmp_path, dtype="float32"):
    spec = ModelSpec(name="tiny-random-llama", dtype=dtype, lora=LoraSpec(r=4, dropout=0.0))
    model, tok = load_policy(spec, models_root=tmp_path, device="cpu", seed=0)
    with torch.no_grad():  # B starts at zero: a trained adapter has moved it
        for la in lora_layers(model):
            la.b.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return model, tok


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()  # [1, L, V]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_folded_model_is_the_adapted_model_and_follows_each_sync(tmp_path, dtype):
    model, tok = _policy(tmp_path, dtype)
    engine = HFEngine(model, tok, "cpu", SamplingParams(max_new_tokens=4), fold=True)
    ids = tok("Question: 1+1?\nAnswer:", return_tensors="pt")["input_ids"]
    torch_dtype = getattr(torch, dtype)
    # float32: the layers' sums run over the hidden size, in another order; bfloat16: both paths round every
    # layer's output to 8 bits of mantissa, which dominates (measured 4 eps of the logits' scale)
    tol = dict(terms=model.config.hidden_size) if dtype == "float32" else dict(terms=1, ulps=16)
    assert_close(_logits(engine.sampler, ids), _logits(engine.model, ids), dtype=torch_dtype, **tol)
    with torch.no_grad():  # a training step moves the adapter
        for la in lora_layers(model):
            la.a.weight.add_(0.1)
    before = _logits(engine.sampler, ids)
    engine.sync(model)
    after = _logits(engine.sampler, ids)
    assert not torch.equal(before, after)
    assert_close(after, _logits(engine.model, ids), dtype=torch_dtype, **tol)
    # every weight but the adapted ones is the rollout copy's (and so the policy's frozen base) itself
    shared = {p.data_ptr() for p in engine.model.parameters()}
    own = [n for n, p in engine.sampler.named_parameters() if p.data_ptr() not in shared]
    assert own and len(own) == len(lora_layers(model)) and all(n.endswith("proj.weight") for n in own)
    # the matmuls' weights in the model's dtype (a bfloat16 model's norms' scales are float32: model.activations)
    assert all(p.dtype == torch_dtype for p in engine.sampler.parameters() if p.dim() == 2)


def test_the_folded_sampler_draws_what_the_adapter_draws(tmp_path):
    model, tok = _policy(tmp_path)
    params = SamplingParams(max_new_tokens=12, temperature=0.8)
    plain = HFEngine(model, tok, "cpu", params).generate(["Question: 1+1?\nAnswer:", "Hi"], 4, seeds=[1, 2])
    folded = HFEngine(model, tok, "cpu", params, fold=True)
    assert folded.folded is not None
    got = folded.generate(["Question: 1+1?\nAnswer:", "Hi"], 4, seeds=[1, 2])
    assert got.completions == plain.completions  # the same model: rounding never decides a draw here
    # old log-probs stay the unfolded layers' own: the first epoch's ratio is exactly 1 (tests/worker/engines)
    assert torch.equal(folded.logprobs(got, micro_batch_size=8), HFEngine(model, tok, "cpu", params).logprobs(
        got, micro_batch_size=8))


def test_only_plain_lora_linear_layers_fold(tmp_path):
    model, _ = _policy(tmp_path)
    assert foldable(model) is not None
    full, _ = load_policy(ModelSpec(name="tiny-random-llama"), models_root=tmp_path, device="cpu", seed=0)
    assert foldable(full) is None
    dora = get_peft_model(full, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True))
    assert foldable(dora) is None  # its magnitude vector rescales W0 + s·B·A column by column
    assert FoldedSampler(model, foldable(model)).model is not None


def test_the_fold_is_planned_on_its_share_of_the_budget(tmp_path):
    model, _ = _policy(tmp_path)
    layers = foldable(model)
    size = adapted_bytes(layers)
    assert size == sum(la.module.base_layer.weight.numel() * 4 for la in layers)
    assert plan_fold(size, budget_gb=10 * size / GB).fold
    assert not plan_fold(size, budget_gb=9 * size / GB).fold
    unknown = plan_fold(size, budget_gb=None)
    assert not unknown.fold and "unknown" in unknown.describe()
