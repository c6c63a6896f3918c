import numpy as np
import pytest
import torch

from service.core.specs import LoraSpec, ModelSpec
from service.core.tinker.sampling import MASK_LOGPROB, PromptAsk, TargetIds
from tests.numerics import assert_close
from worker.model.loading import load_policy
from worker.session.prompt_scoring import score_prompt

PROMPT = [5, 17, 40, 2, 9, 11, 3, 8]


@pytest.fixture(scope="module")
def model(models_root):
    spec = ModelSpec(name="tiny-random-llama", dtype="float32", lora=LoraSpec(r=4, dropout=0.0))
    model, _ = load_policy(spec, models_root=models_root, device="cpu", seed=0)
    return model.eval()


@pytest.fixture(scope="module")
def full(model) -> torch.Tensor:
    """[P-1, V]: row i, the log-probs of position i + 1 given the tokens before it, one plain forward."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([PROMPT])).logits[0, :-1].float(), -1)


def test_logprobs_and_topk_of_the_whole_prompt_or_its_last_tokens(model, full):
    picked = full.gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0].numpy()  # [P-1]
    top = torch.topk(full, 5, -1)
    whole = score_prompt(model, PROMPT, PromptAsk(logprobs=True, topk=5))
    assert np.isnan(whole.logprobs[0])
    assert_close(whole.logprobs[1:], picked, terms=model.config.hidden_size)
    assert whole.topk.ids.shape == (8, 5) and whole.topk.ids.dtype == np.int32
    assert (whole.topk.ids[0] == 0).all() and (whole.topk.logprobs[0] == MASK_LOGPROB).all()  # no context
    np.testing.assert_array_equal(whole.topk.ids[1:], top.indices.numpy())
    assert_close(whole.topk.logprobs[1:], top.values, terms=model.config.hidden_size)
    last = score_prompt(model, PROMPT, PromptAsk(logprobs=True, topk=5, last_n=3))
    assert np.isnan(last.logprobs[:5]).all() and (last.topk.logprobs[:5] == MASK_LOGPROB).all()
    assert_close(last.logprobs[5:], picked[4:], terms=model.config.hidden_size)
    np.testing.assert_array_equal(last.topk.ids[5:], top.indices[4:].numpy())
    assert last.targets is None and last.alt_ids is None


def test_target_ids_score_where_named_and_zero_elsewhere(model, full):
    ids = np.full((7, 3), -1, dtype=np.int64)
    ids[2] = [4, 100, -1]
    ids[6, 2] = 17
    got = score_prompt(model, PROMPT, PromptAsk(targets=TargetIds(ids))).targets
    want = np.zeros((7, 3), dtype=np.float32)
    want[2, :2] = full[2, [4, 100]].numpy()
    want[6, 2] = full[6, 17].item()
    assert_close(got, want, terms=model.config.hidden_size)


def test_alternative_draws_follow_the_seed_and_the_temperature(model, full):
    ask = PromptAsk(alt_k=6, temperature=0.7, seed=3)
    a, b = score_prompt(model, PROMPT, ask), score_prompt(model, PROMPT, ask)
    assert a.alt_ids.shape == (7, 6) and a.alt_ids.dtype == np.int64
    np.testing.assert_array_equal(a.alt_ids, b.alt_ids)  # the request's own seed
    assert not np.array_equal(a.alt_ids, score_prompt(model, PROMPT, PromptAsk(alt_k=6, temperature=0.7,
                                                                               seed=4)).alt_ids)
    scaled = torch.log_softmax(full / 0.7, -1)  # the distribution they are drawn from, and scored under
    assert_close(a.alt_logprobs, scaled.gather(-1, torch.from_numpy(a.alt_ids)), terms=model.config.hidden_size)
    greedy = score_prompt(model, PROMPT, PromptAsk(alt_k=2, temperature=0.0))
    np.testing.assert_array_equal(greedy.alt_ids, full.argmax(-1, keepdim=True).expand(-1, 2).numpy())
    one = score_prompt(model, PROMPT[:1], PromptAsk(logprobs=True, alt_k=2))
    assert one.alt_ids.shape == (0, 2) and np.isnan(one.logprobs).all() and one.logprobs.shape == (1,)
