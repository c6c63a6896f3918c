import numpy as np
import pytest

from service.core.tinker.requests import SampleIn, TensorIn
from service.core.tinker.sampling import (
    MAX_K,
    PromptScores,
    SampledSequence,
    TopK,
    check_widths,
    encode_sample_response,
    prompt_ask,
    sample_response_json,
    target_ids,
)
from service.core.tinker.wire import WireError

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.response_conv import deserialize_sample_response  # noqa: E402

IDS = np.full((4, 3), -1, dtype=np.int64)
IDS[1, 0], IDS[3, 2] = 7, 2


def sent(td: types.TensorData) -> TensorIn:
    """A TensorData as the SDK's JSON body carries it, validated as the API does."""
    return TensorIn(data=np.asarray(td.data).tolist(), dtype=td.dtype, shape=td.shape,
                    sparse_crow_indices=td.sparse_crow_indices, sparse_col_indices=td.sparse_col_indices)


def test_target_ids_read_dense_and_sparse_alike():
    import torch

    dense = target_ids(sent(types.TensorData.from_torch(torch.from_numpy(IDS))), prompt_len=5)
    sparse_td = types.TensorData.from_torch_sparse(torch.from_numpy(IDS), pad_value=-1)
    assert sparse_td.sparse_crow_indices is not None  # 2 of 12 cells: sent sparse
    sparse = target_ids(sent(sparse_td), prompt_len=5)
    np.testing.assert_array_equal(dense.ids, IDS)
    np.testing.assert_array_equal(sparse.ids, IDS)
    assert dense.crow is None and sparse.crow.tolist() == [0, 0, 1, 1, 2] and sparse.first_row == 1


@pytest.mark.parametrize("body, field, says", [
    ({"data": [1.0] * 12, "dtype": "float32", "shape": [4, 3]}, "target_prompt_logprobs.dtype", "int64"),
    ({"data": [1] * 15, "dtype": "int64", "shape": [5, 3]}, "target_prompt_logprobs.shape", "[4, K]"),
    ({"data": [1] * 11, "dtype": "int64", "shape": [4, 3]}, "target_prompt_logprobs.data", "11 values"),
    ({"data": [-1] * 12, "dtype": "int64", "shape": [4, 3]}, "target_prompt_logprobs.data", "names no token"),
    ({"data": [-2] + [1] * 11, "dtype": "int64", "shape": [4, 3]}, "target_prompt_logprobs.data", "token id -2"),
    ({"data": [1.5] * 12, "dtype": "int64", "shape": [4, 3]}, "target_prompt_logprobs.data", "whole numbers"),
    ({"data": [3], "dtype": "int64", "shape": [4, 3], "sparse_crow_indices": [0, 1, 1, 1],
      "sparse_col_indices": [0]}, "target_prompt_logprobs.sparse_crow_indices", "CSR"),
    ({"data": [3], "dtype": "int64", "shape": [4, 3], "sparse_crow_indices": [0, 1, 1, 1, 1],
      "sparse_col_indices": [3]}, "target_prompt_logprobs.sparse_crow_indices", "CSR"),
])
def test_target_ids_refused_naming_the_field(body, field, says):
    with pytest.raises(WireError) as err:
        target_ids(TensorIn.model_validate(body), prompt_len=5)
    assert err.value.field == field and says in err.value.message


def test_a_token_beyond_the_vocabulary_is_refused():
    with pytest.raises(WireError, match=r"token id 7 is outside the model's vocabulary \[0, 5\)"):
        target_ids(TensorIn(data=IDS.ravel().tolist(), dtype="int64", shape=[4, 3]), prompt_len=5, vocab_size=5)


@pytest.mark.parametrize("kw, field", [
    ({"topk_prompt": MAX_K + 1}, "topk_prompt_logprobs"),
    ({"alt_k": MAX_K + 1}, "prompt_alt_tokens_k"),
    ({"topk_sample": 64, "n": 256, "max_tokens": 8192}, "topk_sample_logprobs"),
    ({"last_n": 2}, "prompt_logprobs_last_n"),  # without prompt_logprobs
    ({"last_n": 5, "prompt_logprobs": True}, "prompt_logprobs_last_n"),  # beyond len(prompt) - 1
])
def test_widths_beyond_an_answer_are_refused(kw, field):
    args = dict(prompt_len=5, n=1, max_tokens=16, topk_prompt=0, topk_sample=0, alt_k=0, last_n=None,
                prompt_logprobs=False) | kw
    with pytest.raises(WireError) as err:
        check_widths(**args)
    assert err.value.field == field


def test_widths_within_an_answer_pass():
    check_widths(prompt_len=5, n=4, max_tokens=256, topk_prompt=MAX_K, topk_sample=20, alt_k=MAX_K, last_n=4,
                 prompt_logprobs=True)


def test_a_request_body_is_checked_as_a_whole():
    body = {"sampling_session_id": "s", "prompt": {"chunks": [{"tokens": [1, 2, 3, 4, 5]}]},
            "num_samples": 2, "sampling_params": {"max_tokens": None}, "prompt_logprobs": True,
            "prompt_logprobs_last_n": 3, "topk_prompt_logprobs": 5, "topk_sample_logprobs": 0,
            "prompt_alt_tokens_k": 0, "target_prompt_logprobs": {"data": IDS.ravel().tolist(), "dtype": "int64",
                                                                  "shape": [4, 3]}}
    ask = prompt_ask(SampleIn.model_validate(body), prompt_len=5)
    np.testing.assert_array_equal(ask.targets.ids, IDS)
    assert (ask.logprobs, ask.topk, ask.last_n, ask.alt_k) == (True, 5, 3, 0)
    assert prompt_ask(SampleIn.model_validate(body | {"target_prompt_logprobs": None}), prompt_len=5).targets is None
    with pytest.raises(WireError, match="prompt_logprobs_last_n: 3: must be between 1 and len"):
        prompt_ask(SampleIn.model_validate(body), prompt_len=3)
    with pytest.raises(WireError, match="outside the model's vocabulary"):
        prompt_ask(SampleIn.model_validate(body), prompt_len=5, vocab_size=3)


def test_the_sdk_reads_every_answer_back_in_the_layout_asked():
    rng = np.random.default_rng(0)
    top = TopK(rng.integers(0, 50, (3, 2)).astype(np.int32), rng.normal(size=(3, 2)).astype(np.float32))
    prompt_top = TopK(np.zeros((5, 2), np.int32), np.full((5, 2), -99999.0, np.float32))
    prompt_top.ids[2:] = 4
    prompt_top.logprobs[2:] = -1.5
    targets = np.zeros((4, 3), np.float32)
    targets[1, 0], targets[3, 2] = -2.0, -3.0
    scores = PromptScores(logprobs=np.array([np.nan, np.nan, -1.0, -2.0, -0.5], np.float32), topk=prompt_top,
                          targets=targets, alt_ids=np.arange(8).reshape(4, 2),
                          alt_logprobs=-np.ones((4, 2), np.float32))
    import torch

    sparse = target_ids(sent(types.TensorData.from_torch_sparse(torch.from_numpy(IDS), pad_value=-1)), prompt_len=5)
    got = deserialize_sample_response(encode_sample_response(
        [SampledSequence([1, 2, 3], [-0.1, -0.2, -0.3], "length", top)], scores, sparse))
    seq = got.sequences[0]
    assert seq.tokens == [1, 2, 3] and seq.stop_reason == "length"
    assert seq.topk_logprobs == [list(zip(r.tolist(), v.tolist())) for r, v in zip(top.ids, top.logprobs)]
    assert got.prompt_logprobs[:2] == [None, None] and got.prompt_logprobs[2:] == [-1.0, -2.0, -0.5]
    assert got.topk_prompt_logprobs[:2] == [None, None] and got.topk_prompt_logprobs[2] == [(4, -1.5), (4, -1.5)]
    assert got.target_prompt_logprobs.sparse_crow_indices == [0, 0, 1, 1, 2]  # sparse as sent
    assert list(got.target_prompt_logprobs.data) == [-2.0, -3.0]
    np.testing.assert_array_equal(got.target_prompt_logprobs.to_torch().numpy(), targets)
    assert got.prompt_alt_tokens.tokens.to_torch().tolist() == np.arange(8).reshape(4, 2).tolist()
    # the same answer as JSON, for a client that does not ask for protobuf: the values the SDK read
    as_json = sample_response_json(encode_sample_response(
        [SampledSequence([1, 2, 3], [-0.1, -0.2, -0.3], "length", top)], scores, sparse))
    js = as_json["sequences"][0]
    assert js["tokens"] == seq.tokens and js["logprobs"] == seq.logprobs and js["stop_reason"] == "length"
    assert [[tuple(p) for p in row] for row in js["topk_logprobs"]] == seq.topk_logprobs
    assert as_json["prompt_logprobs"] == got.prompt_logprobs
    assert [None if r is None else [tuple(p) for p in r] for r in as_json["topk_prompt_logprobs"]] \
        == got.topk_prompt_logprobs
    assert as_json["target_prompt_logprobs"]["sparse_crow_indices"] == [0, 0, 1, 1, 2]
    assert as_json["prompt_alt_tokens"]["tokens"]["data"] == list(range(8))
    dense = deserialize_sample_response(encode_sample_response([], scores, target_ids(
        TensorIn(data=IDS.ravel().tolist(), dtype="int64", shape=[4, 3]), prompt_len=5)))
    assert dense.target_prompt_logprobs.sparse_crow_indices is None
    np.testing.assert_array_equal(np.asarray(dense.target_prompt_logprobs.data).reshape(4, 3), targets)
