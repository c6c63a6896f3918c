"""A session run's sample requests in batches bounded by rows and token positions."""

import pytest
import torch

from service.core.specs import LoraSpec, ModelSpec
from service.core.tinker.sampling import PromptAsk
from service.core.tinker.wire import SamplerRef
from worker.model.loading import load_policy
from worker.reporting import Reporter
from worker.session import token_sampler
from worker.session.sampling import SAMPLE_BATCH_ROWS, SampleCall, batches, sample
from worker.session.state import Session


def _call(n: int, prompt_len: int, max_tokens: int, seed: int | None = 1) -> SampleCall:
    request = token_sampler.Request(list(range(3, 3 + prompt_len)), n,
                                    token_sampler.Params(max_tokens=max_tokens, temperature=1.0, seed=seed))
    return SampleCall("m:v0", SamplerRef("m", "v", 0), request, PromptAsk())


def test_batches_hold_the_rows_and_positions_budget_splitting_a_call_where_it_must():
    calls = [_call(10, 5, 5), _call(3, 2, 2), _call(200, 1, 1)]
    got = batches(calls, [0, 1, 2], batch_tokens=40)  # call 0: 10 positions a row, 4 rows a batch
    assert [[(p.call, p.request.n) for p in b] for b in got][:3] == [[(0, 4)], [(0, 4)], [(0, 2), (1, 2)]]
    for b in got:  # each batch within both budgets
        assert sum(p.request.n for p in b) <= SAMPLE_BATCH_ROWS
        assert sum(p.request.n for p in b) * max(len(p.request.prompt) + p.request.params.max_tokens
                                                 for p in b) <= 40
    assert sum(p.request.n for b in got for p in b if p.call == 2) == 200  # every row, in batches of 20
    streams = {id(p.request.stream) for b in got for p in b if p.call == 0}
    assert len(streams) == 1  # the parts of a call draw from one stream
    assert [p.request.n for p in batches([_call(1, 50, 50)], [0], batch_tokens=40)[0]] == [1]  # too long: alone


@pytest.fixture(scope="module")
def session(models_root):
    spec = ModelSpec(name="tiny-random-llama", dtype="float32", lora=LoraSpec(r=4, dropout=0.0))
    model, tok = load_policy(spec, models_root=models_root, device="cpu", seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    return Session(model=model.eval(), tokenizer=tok, optimizer=torch.optim.AdamW(params), params=params,
                   vocab_size=model.get_input_embeddings().num_embeddings)


def test_a_split_request_draws_on_where_its_last_part_stopped(session):
    """Split in parts of 2 rows, a seeded request is the same on every run, and no part repeats the draws of
    the part before (each part taking a fresh stream from the seed would)."""
    def run():
        out = sample(session, [_call(6, 4, 6, seed=7)], Reporter(), batch_tokens=2 * 10)
        return [tuple(r.completion for r in out[0].rows)]
    first = run()[0]
    assert len(first) == 6 and run()[0] == first
    assert first[0:2] != first[2:4] != first[4:6], first


def test_a_request_past_the_models_context_is_refused(session):
    import json
    from dataclasses import replace

    from service.core.tinker.wire import WireError
    from worker.session.sampling import parse_sample

    body = json.dumps({"sampling_session_id": "m:v0", "num_samples": 1, "prompt": {"chunks": [{"tokens": [5] * 8}]},
                       "sampling_params": {"max_tokens": 5}}).encode()
    with pytest.raises(WireError, match="8 prompt tokens \\+ max_tokens 5 is over the model's context of 12") as e:
        parse_sample(replace(session, context=12), body)
    assert e.value.field == "sampling_params.max_tokens"
    assert parse_sample(replace(session, context=13), body).request.n == 1
