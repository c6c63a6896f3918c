import numpy as np
import pytest
import torch

from service.core.specs import LoraSpec, ModelSpec
from tests.numerics import approx, assert_close
from worker.model.loading import load_policy
from worker.session import token_sampler
from worker.session.token_sampler import Params, Request


@pytest.fixture(scope="module")
def model(models_root):
    spec = ModelSpec(name="tiny-random-llama", lora=LoraSpec(r=4, dropout=0.0))
    model, _ = load_policy(spec, models_root=models_root, device="cpu", seed=0)
    return model.eval()


def _scored(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """The log-prob of each completion token under the temperature-scaled logits, one unpadded forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_a_batched_request_samples_what_it_samples_alone(model):
    """Padding on the left, masks and positions: each request's rows come out as if sampled alone."""
    requests = [Request([5, 17, 40, 2, 9, 11, 3], 3, Params(max_tokens=9, temperature=0.8, seed=1)),
                Request([7, 8], 2, Params(max_tokens=5, temperature=1.0, top_k=20, seed=2)),
                Request([100, 3, 4, 4], 1, Params(max_tokens=6, temperature=0.0)),
                Request([12, 13, 14], 2, Params(max_tokens=7, temperature=0.7, top_p=0.9, seed=3))]
    together = token_sampler.sample_many(model, requests)
    for r, rows in zip(requests, together, strict=True):
        alone = token_sampler.sample(model, r.prompt, r.n, r.params)
        assert [x.tokens for x in rows] == [x.tokens for x in alone]
        assert [len(x.tokens) for x in rows] == [r.params.max_tokens] * r.n  # no stop asked: max_tokens each
        for x, y in zip(rows, alone, strict=True):
            assert x.logprobs == approx(y.logprobs, terms=model.config.hidden_size)
            # the log-probs are those the trainer computes on the unpadded sequence
            assert x.logprobs == approx(_scored(model, r.prompt, x.tokens, r.params.temperature or 1.0),
                                        terms=model.config.hidden_size)


def test_stops_end_rows_one_by_one(model):
    first = token_sampler.sample(model, [5, 6, 7], 4, Params(max_tokens=12, temperature=1.0, seed=4))
    stop = first[0].tokens[2]  # a token row 0 draws third, drawn again with the same seed
    rows = token_sampler.sample_many(model, [Request([5, 6, 7], 4, Params(max_tokens=12, temperature=1.0, seed=4,
                                                                           stop_tokens=frozenset({stop}))),
                                             Request([9], 1, Params(max_tokens=3, seed=5))])
    assert rows[0][0].tokens == first[0].tokens[:3] and rows[0][0].stop_reason == "stop"
    for row in rows[0]:
        assert (row.stop_reason == "stop") == (stop in row.tokens)
        assert row.tokens.count(stop) <= 1 and (stop not in row.tokens or row.tokens[-1] == stop)
    assert len(rows[1][0].tokens) == 3 and rows[1][0].stop_reason == "length"


def test_stop_strings_and_zero_tokens(model):
    def decode(ids: list[int]) -> str:  # a stand-in tokenizer
        return "".join(chr(97 + t % 26) for t in ids)

    free = token_sampler.sample(model, [1, 2], 1, Params(max_tokens=10, seed=6))[0]
    stop = decode(free.tokens[3:5])
    cut = token_sampler.sample(model, [1, 2], 1, Params(max_tokens=10, seed=6, stop_strings=(stop,)), decode)[0]
    assert stop in decode(cut.tokens) and stop not in decode(cut.tokens[:-1]) and cut.stop_reason == "stop"
    assert token_sampler.sample(model, [1, 2], 2, Params(max_tokens=0)) == [
        token_sampler.Sampled([], [], "length")] * 2


def test_the_top_k_of_each_sampled_position_under_the_sampling_distribution(model):
    asks = Request([5, 17, 40], 2, Params(max_tokens=5, temperature=0.8, seed=9, topk_logprobs=3))
    plain = Request([7, 8], 1, Params(max_tokens=4, seed=2))
    rows, others = token_sampler.sample_many(model, [asks, plain])
    assert others[0].topk is None
    for row in rows:
        assert row.topk.ids.shape == row.topk.logprobs.shape == (5, 3)
        ids = torch.tensor([asks.prompt + row.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(asks.prompt) - 1:-1].float() / 0.8
        top = torch.topk(torch.log_softmax(logits, -1), 3, -1)
        np.testing.assert_array_equal(row.topk.ids, top.indices.numpy())
        assert_close(row.topk.logprobs, top.values, terms=model.config.hidden_size)
        # the sampled token's log-prob is scored the same way: at most the best of the top-k
        assert (np.asarray(row.logprobs) <= row.topk.logprobs[:, 0] + 1e-6).all()
