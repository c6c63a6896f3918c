"""A group's prompt computed once in the teacher-forced forward: the log-probs, entropies and every
gradient of the per-row forward, to float32's rounding of sums that are taken in another order."""

import pytest
import torch

from service.core.specs import LoraSpec, ModelSpec
from tests.numerics import assert_close
from worker.batch import SamplingParams
from worker.engines.hf_engine import HFEngine
from worker.model import prefix
from worker.model.forward import sequence_logprobs
from worker.model.loading import enable_checkpointing, load_policy

PROMPTS = ["Question: what is 12 + 30?\nAnswer:", "Hi", "Question: 7 * 6?\nAnswer:"]


def _policy(tmp_path, lora: bool):
    spec = ModelSpec(name="tiny-random-llama", dtype="float32", lora=LoraSpec(r=4, dropout=0.0) if lora else None)
    model, tok = load_policy(spec, models_root=tmp_path, device="cpu", seed=0)
    with torch.no_grad():  # a trained adapter: B away from its zero start, so the prompt's gradient reaches A
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model, tok


def _batch(model, tok):
    engine = HFEngine(model, tok, "cpu", SamplingParams(max_new_tokens=10, temperature=0.9))
    return engine.generate(PROMPTS, 3, seeds=[1, 2, 3])  # [9]: three prompts of three lengths, left-padded


def _logp_and_grads(model, batch, share: bool):
    model.zero_grad(set_to_none=True)
    logp, ent = sequence_logprobs(model, batch, 0.9, with_entropy=True, share_prompts=share)
    (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), ent, grads


@pytest.mark.parametrize("lora", [True, False])
def test_shared_prompts_give_the_per_row_log_probs_entropy_and_gradients(tmp_path, lora, monkeypatch):
    model, tok = _policy(tmp_path, lora)
    batch = _batch(model, tok)
    rows = [4, 0, 7, 3, 8, 1]  # a shuffled micro-batch: groups cut apart, rows out of order
    mb = batch.select(rows)
    for row, n in ((1, 4), (4, 7)):  # rows that ended early (a random model never says EOS): right padding too
        mb.completion_mask[row, n:] = 0
        mb.completion_ids[row, n:] = tok.pad_token_id
    model.train()
    shared_forwards = []
    real = prefix.prompt_groups
    monkeypatch.setattr(prefix, "prompt_groups", lambda *a: shared_forwards.append(real(*a)) or shared_forwards[-1])
    shared = _logp_and_grads(model, mb, share=True)
    inv = shared_forwards[0].inverse.tolist()  # the rows' prompts are 1, 0, 2, 1, 2, 0: three, two rows each
    assert len(shared_forwards[0].first) == 3 and inv[0] == inv[3] and inv[1] == inv[5] and inv[2] == inv[4]
    each = _logp_and_grads(model, mb, share=False)
    hidden = model.config.hidden_size
    assert_close(shared[0], each[0], terms=hidden)
    assert_close(shared[1], each[1], terms=hidden)
    assert shared[2].keys() == each[2].keys() and shared[2]
    for name, g in each[2].items():  # a gradient sums over the rows' positions and the hidden size
        assert_close(shared[2][name], g, terms=hidden * mb.completion_mask.numel(), msg=name)


def test_rows_of_distinct_prompts_and_checkpointed_layers_take_the_per_row_forward(tmp_path):
    model, tok = _policy(tmp_path, lora=True)
    batch = _batch(model, tok)
    assert prefix.prompt_groups(batch.prompt_ids[[0, 3, 6]], batch.prompt_mask[[0, 3, 6]]) is None
    groups = prefix.prompt_groups(batch.prompt_ids, batch.prompt_mask)
    assert groups is not None and len(groups.first) == 3
    assert torch.equal(batch.prompt_ids[groups.first][groups.inverse], batch.prompt_ids)
    enable_checkpointing(model, reentrant=False)
    model.train()
    decoder = model.get_base_model().get_decoder()
    assert prefix.checkpointing(decoder)
    with torch.no_grad():  # no backward to replay: the cache is kept, so sharing is allowed
        assert not prefix.checkpointing(decoder)
    logp, _ = sequence_logprobs(model, batch, 0.9, share_prompts=True)  # checkpointed: one forward per row
    model.eval()
    with torch.no_grad():
        plain, _ = sequence_logprobs(model, batch, 0.9)
    assert_close(logp.detach(), plain, terms=model.config.hidden_size)


@pytest.mark.parametrize("streamed", [False, True])
def test_taped_prompts_give_each_row_its_own_share_of_the_prompts_gradient(tmp_path, streamed, monkeypatch):
    """Under taped_prompts() the rows read their prompt's keys, values and last hidden state from leaves of
    their own: the hooks' completion scores plus <leaf grads, J_u X> (one forward-mode pass of two micro-batches'
    prompts, merged) are each row's <grad L_i, X> of one forward per row, and the update folded from them is
    the selected rows' gradient, in float64 to the rounding of RMSNorm's float32 cast. `streamed`: scored and
    folded as each micro-batch ends, as `positive` does, with the step's prompts given ahead (one forward-mode
    pass and one backward of all of them, each micro-batch's prompts at their place among the step's)."""
    from worker.algos.influence import GhostHooks
    from worker.algos.lora import lora_layers

    spec = ModelSpec(name="tiny-random-llama", dtype="float64", lora=LoraSpec(r=4, dropout=0.0))
    model, tok = load_policy(spec, models_root=tmp_path, device="cpu", seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    batch = _batch(model, tok)
    micro = [[4, 0, 7, 3], [8, 1, 2, 5, 6]]  # groups cut apart; prompts of other lengths in each
    chosen = torch.tensor([1.0, 0, 1, 1, 0, 1, 0, 1, 1], dtype=torch.float64)
    model.train()

    def hooked(share: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with GhostHooks(model, keep_factors=True) as hooks:
            sequence_logprobs(model, batch.select([0, 5]), 0.9)[0].sum().backward()
            hooks.capture_validation_gradient()
            hooks.start_scoring(len(batch), "cpu", prompts=(batch.prompt_ids, batch.prompt_mask) if streamed else None)
            for rows in micro:
                hooks.place(torch.tensor(rows))
                with prefix.taped_prompts() as tape:
                    logp, _ = sequence_logprobs(model, batch.select(rows), 0.9, share_prompts=share)
                    (logp * torch.linspace(-1, 1, logp.shape[1], dtype=logp.dtype)).sum().backward()
                assert len(tape.parts) == (1 if share else 0)
                for part in tape.parts:
                    hooks.add_prompt(part)
                if streamed:
                    assert hooks.scores.shape == (len(batch),)
                    hooks.fold(chosen)
            scores = hooks.scores.clone()
            if not streamed:
                hooks.fold(chosen)
            return scores, [hooks.subset_gradient(w).clone() for layer in hooks.layers for w in (layer.a.weight, layer.b.weight)]

    passes = {"tangents": 0, "outputs": 0}

    def counted(name):
        real = getattr(prefix.PromptPart, name)

        def call(self, *a, **kw):
            passes[name] += 1
            return real(self, *a, **kw)
        return call
    for name in passes:
        monkeypatch.setattr(prefix.PromptPart, name, counted(name))
    shared = hooked(True)
    # one forward-mode pass of the prompts for the scores (`outputs`, run by `tangents` too), and backwards of them
    # for the update, a few prompts at a time (no more positions than a micro-batch held), whether the
    # micro-batches' prompts are merged at the end or taken ahead
    assert passes["tangents"] == 1 and passes["outputs"] >= 2
    each = hooked(False)
    assert_close(shared[0], each[0], dtype=torch.float32, terms=batch.completion_ids.numel())
    for a, b in zip(shared[1], each[1]):
        assert_close(a, b, dtype=torch.float32, terms=batch.completion_ids.numel())
    assert len(shared[1]) == 2 * len(lora_layers(model)) and any(bool(x.abs().sum() > 0) for x in shared[1])
