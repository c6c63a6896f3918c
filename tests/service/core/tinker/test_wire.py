"""forward_backward bodies as the SDK encodes them (its own protobuf messages), checked before any work."""

import numpy as np
import pytest

from service.core.tinker.wire import WireError, decode_forward_backward, pb


def _body(tokens: list[int], targets: np.ndarray) -> bytes:
    p = pb()
    msg = p.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
    dtype = {np.dtype(np.int64): p.DTYPE_INT64, np.dtype(np.float32): p.DTYPE_FLOAT32}[targets.dtype]
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.dense = dtype, targets.tobytes()
    return msg.SerializeToString()


def test_a_datum_within_the_context_decodes():
    body = _body([1, 2, 3], np.array([2, 3, 4], dtype=np.int64))
    request = decode_forward_backward(body, vocab_size=10, context=3)
    assert request.data[0].tokens.tolist() == [1, 2, 3] and request.tokens == 3


def test_a_datum_longer_than_the_context_is_refused_naming_it():
    body = _body(list(range(5)), np.arange(1, 6, dtype=np.int64))
    with pytest.raises(WireError, match="5 tokens, over the model's context of 4") as e:
        decode_forward_backward(body, vocab_size=10, context=4)
    assert e.value.field == "data.0.model_input"


def test_float_target_tokens_are_refused():
    body = _body([1, 2], np.array([2.0, 3.0], dtype=np.float32))
    with pytest.raises(WireError, match="token ids are integers") as e:
        decode_forward_backward(body)
    assert e.value.field == "data.0.loss_fn_inputs.target_tokens"


def test_a_forward_backward_result_reads_the_same_as_json():
    """For a client that does not ask for protobuf: the same values, per datum, in the SDK's JSON form."""
    from service.core.tinker.wire import encode_forward_backward_output, forward_backward_output_json

    per_datum = [{"logprobs": np.array([-1.5, -0.25], dtype=np.float32)},
                 {"logprobs": np.array([-3.0], dtype=np.float32)}]
    out = forward_backward_output_json(encode_forward_backward_output(per_datum, {"loss:sum": 4.75}))
    assert out == {"loss_fn_output_type": "ArrayRecord", "metrics": {"loss:sum": 4.75}, "loss_fn_outputs": [
        {"logprobs": {"data": [-1.5, -0.25], "dtype": "float32", "shape": [2]}},
        {"logprobs": {"data": [-3.0], "dtype": "float32", "shape": [1]}}]}
