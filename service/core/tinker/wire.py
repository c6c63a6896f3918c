"""The tinker SDK's wire formats, read and written without importing the SDK (which pulls in torch).

`forward_backward` bodies arrive as the SDK's protobuf `ForwardBackwardRequest` (optionally zstd-
compressed); its result goes back as protobuf `ForwardBackwardOutput`. The message definitions are
the installed SDK's own (`tinker/proto/tinker_public_pb2.py`, which needs only protobuf), loaded by
file so both ends use one schema. Everything else is JSON. This module decodes a body into typed
records and checks them; the API refuses a bad body with the field named, the worker decodes it
again to run it.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

SDK_VERSIONS_TESTED = ("0.38.0",)


@lru_cache(maxsize=1)
def pb() -> ModuleType:
    """The SDK's generated protobuf module, loaded from its file: not `import tinker`, whose package
    imports torch, which the API never loads."""
    spec = importlib.util.find_spec("tinker")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the tinker SDK is not installed: pip install tinker==0.38.0")
    path = Path(next(iter(spec.submodule_search_locations))) / "proto" / "tinker_public_pb2.py"
    module_spec = importlib.util.spec_from_file_location("_grpo_jobs_tinker_public_pb2", path)
    if module_spec is None or module_spec.loader is None:
        raise RuntimeError(f"the tinker SDK's protobuf schema cannot be loaded from {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


class WireError(ValueError):
    """A request that cannot run as sent: `field` is where (dotted, e.g. `data.0.loss_fn_inputs.weights`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class LossDef:
    """What a built-in loss reads: per-token inputs it needs and may take, config keys and their defaults
    (None: the caller must send it)."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: dict[str, float | None] = field(default_factory=dict)


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # bounds of the ratio itself (PPO's 0.2)
_RL = ("target_tokens", "logprobs", "advantages")
LOSSES: dict[str, LossDef] = {
    "cross_entropy": LossDef(required=("target_tokens",), optional=("weights",)),
    "importance_sampling": LossDef(required=_RL),
    "ppo": LossDef(required=_RL, config=dict(_CLIP)),
    "cispo": LossDef(required=_RL, config=dict(_CLIP)),
    "dro": LossDef(required=_RL, config={"beta": None}),
    "gspo": LossDef(required=_RL, optional=("sequence_ratio_mask",), config=dict(_CLIP)),
}
# Named by the SDK, refused here with the reason (a 400 naming loss_fn)
UNSUPPORTED_LOSSES = {
    "stable_reinforce": "not supported here: its objective is not published (the SDK calls it alpha), and it "
                        "needs each sequence's record from sampling with record_stability_info",
    "custom": "server-side custom losses are not supported: the SDK runs them client-side "
              "(forward_backward_custom) when the server says so, as this one does",
}
_DTYPES = {"float32": np.float32, "int64": np.int64, "int32": np.int32}


@dataclass(frozen=True)
class Datum:
    """One sequence: `tokens` [N] is the model input; each input in `inputs` is [N], aligned so that
    position i of `tokens` predicts `inputs["target_tokens"][i]`."""

    tokens: np.ndarray  # [N] int64
    inputs: dict[str, np.ndarray]  # name -> [N]


@dataclass(frozen=True)
class ForwardBackward:
    """A decoded `forward_backward` (or, with `forward_only`, `forward`) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]  # every config key of the loss, defaults filled in
    forward_only: bool
    data: list[Datum]

    @property
    def tokens(self) -> int:
        return sum(len(d.tokens) for d in self.data)


def _tensor(msg: Any, where: str) -> np.ndarray:
    p = pb()
    if msg.HasField("sparse_csr"):
        raise WireError(where, "sparse tensors are not supported here; send it dense")
    dtype = {p.DTYPE_FLOAT32: np.float32, p.DTYPE_INT64: np.int64, p.DTYPE_INT32: np.int32}.get(msg.dtype)
    if dtype is None:
        raise WireError(where, f"dtype {msg.dtype} is not supported (float32, int64, int32)")
    if len(msg.dense) % np.dtype(dtype).itemsize:
        raise WireError(where, "its bytes are not a whole number of values")
    values = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape) or [values.size]
    if len(shape) != 1 or shape[0] != values.size:
        raise WireError(where, f"shape {shape} with {values.size} values: inputs here are one value per token, [N]")
    return values


def _tokens(chunks: Any, where: str) -> np.ndarray:
    parts = []
    for j, chunk in enumerate(chunks):
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(f"{where}.{j}", "only text chunks (token ids) are supported here, not images or audio")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"{where}.{j}", "token bytes are not a whole number of int32 values")
        parts.append(np.frombuffer(raw, dtype=np.int32).astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _config(msg: Any, loss: LossDef) -> dict[str, float]:
    """Every setting of the loss: what was sent (as a number), else its default."""
    sent: dict[str, float] = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config.{key}", "must be a number")
        sent[key] = float(value.number)
    for key, value in msg.loss_fn_config.items():
        sent.setdefault(key, float(value))
    if unknown := sorted(set(sent) - set(loss.config)):
        raise WireError(f"loss_fn_config.{unknown[0]}", f"not a setting of {msg.loss_fn!r} (settings: "
                        f"{', '.join(loss.config) or 'none'})")
    config = {}
    for key, default in loss.config.items():
        value = sent.get(key, default)
        if value is None:
            raise WireError(f"loss_fn_config.{key}", f"required by {msg.loss_fn!r}")
        if not np.isfinite(value):
            raise WireError(f"loss_fn_config.{key}", "must be finite")
        config[key] = value
    if "clip_low_threshold" in config and not 0 <= config["clip_low_threshold"] <= config["clip_high_threshold"]:
        raise WireError("loss_fn_config.clip_low_threshold", "must be >= 0 and <= clip_high_threshold")
    return config


def _datum(d: Any, where: str, loss_fn: str, loss: LossDef, vocab_size: int | None, context: int | None) -> Datum:
    tokens = _tokens(d.model_input, f"{where}.model_input.chunks")
    if tokens.size == 0:
        raise WireError(f"{where}.model_input", "no tokens")
    if context is not None and tokens.size > context:  # refused before its forward pass, whose cost is quadratic
        raise WireError(f"{where}.model_input", f"{tokens.size} tokens, over the model's context of {context}")
    inputs = {}
    for name, tensor in sorted(d.loss_fn_inputs.items()):  # a map: in a fixed order, errors are reproducible
        if name not in loss.required + loss.optional:
            raise WireError(f"{where}.loss_fn_inputs.{name}", f"not an input of {loss_fn!r} (inputs: "
                            f"{', '.join(loss.required + loss.optional)})")
        values = _tensor(tensor, f"{where}.loss_fn_inputs.{name}")
        if values.size != tokens.size:
            raise WireError(f"{where}.loss_fn_inputs.{name}", f"{values.size} values for {tokens.size} input "
                            "tokens: one per input token")
        if name == "target_tokens" and values.dtype.kind != "i":
            raise WireError(f"{where}.loss_fn_inputs.{name}", f"token ids are integers (int64 or int32), not "
                            f"{values.dtype}")
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise WireError(f"{where}.loss_fn_inputs.{name}", "holds a NaN or an infinity")
        inputs[name] = values
    if missing := [n for n in loss.required if n not in inputs]:
        raise WireError(f"{where}.loss_fn_inputs.{missing[0]}", f"required by {loss_fn!r}")
    for name, values in (("model_input", tokens), ("loss_fn_inputs.target_tokens", inputs["target_tokens"])):
        outside = values[(values < 0) | (values >= (vocab_size or np.iinfo(np.int64).max))]
        if outside.size:
            raise WireError(f"{where}.{name}", f"token id {int(outside[0])} is outside the model's vocabulary"
                            + (f" [0, {vocab_size})" if vocab_size else " (negative)"))
    return Datum(tokens=tokens, inputs=inputs)


def decode_forward_backward(body: bytes, *, vocab_size: int | None = None,
                            context: int | None = None) -> ForwardBackward:
    """The request a body holds, checked: the loss exists and gets what it reads, every input has one
    value per input token, token ids are integers in the vocabulary (when `vocab_size` is known), and no
    datum is longer than the model's context (when `context` is known)."""
    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError, or worse for arbitrary bytes
        raise WireError("body", f"not a ForwardBackwardRequest protobuf message ({type(exc).__name__})") from None
    if msg.loss_fn in UNSUPPORTED_LOSSES:
        raise WireError("loss_fn", f"{msg.loss_fn!r} is not supported here: {UNSUPPORTED_LOSSES[msg.loss_fn]}")
    loss = LOSSES.get(msg.loss_fn)
    if loss is None:
        raise WireError("loss_fn", f"unknown loss {msg.loss_fn!r}; one of {', '.join(LOSSES)}")
    config = _config(msg, loss)
    if not msg.data:
        raise WireError("data", "no data: send at least one datum")
    data = [_datum(d, f"data.{i}", msg.loss_fn, loss, vocab_size, context) for i, d in enumerate(msg.data)]
    return ForwardBackward(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn, config=config,
                           forward_only=bool(msg.forward_only), data=data)


def encode_forward_backward_output(per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput` as the SDK decodes it: one record, each field's per-datum float32 arrays
    concatenated with their byte offsets."""
    p = pb()
    out = p.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    record = out.loss_fn_outputs.add()
    record.num_datums = len(per_datum)
    for name in (per_datum[0] if per_datum else {}):
        arrays = [np.ascontiguousarray(d[name], dtype=np.float32).ravel() for d in per_datum]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        batched = record.fields[name]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = offsets.tobytes()
        batched.dtype = p.DTYPE_FLOAT32
    return bytes(out.SerializeToString())


def forward_backward_output_json(body: bytes) -> dict[str, Any]:
    """A stored `ForwardBackwardOutput` in the SDK's JSON form (its `ForwardBackwardOutput` type): for a client
    that did not ask for protobuf. Each datum's fields as `TensorData` (flat float32 values and a shape)."""
    p = pb()
    out = p.ForwardBackwardOutput()
    out.ParseFromString(body)
    datums: list[dict[str, Any]] = []
    for record in out.loss_fn_outputs:
        rows: list[dict[str, Any]] = [{} for _ in range(record.num_datums)]
        for name, batched in record.fields.items():
            values = np.frombuffer(batched.data, dtype=np.float32)
            offsets = np.frombuffer(batched.offsets, dtype=np.int64) // 4
            for i, row in enumerate(rows):
                part = values[offsets[i]:offsets[i + 1]]
                row[name] = {"data": part.tolist(), "dtype": "float32", "shape": [int(part.size)]}
        datums += rows
    return {"loss_fn_output_type": out.loss_fn_output_type, "loss_fn_outputs": datums,
            "metrics": dict(out.metrics)}


@dataclass(frozen=True)
class SamplerRef:
    """What a sampling session samples: a run's weights at a version (`<model_id>:v<n>`, a snapshot
    taken by save_weights_for_sampler) or as saved at a step (`<model_id>:s<n>`, a checkpoint named by
    a tinker:// path)."""

    model_id: str
    source: str  # "v" | "s"
    number: int

    @property
    def key(self) -> str:
        """The weights' name within the run."""
        return f"{self.source}{self.number}"


def sampler_id(model_id: str, version: int) -> str:
    """The sampling session of a run's weights at `version`."""
    return f"{model_id}:v{version}"


def saved_sampler_id(model_id: str, step: int) -> str:
    """The sampling session of a run's weights as saved at `step`."""
    return f"{model_id}:s{step}"


def parse_sampler_id(value: str) -> SamplerRef | None:
    model_id, _, rest = value.rpartition(":")
    source, number = rest[:1], rest[1:]
    if not model_id or source not in ("v", "s") or not number.isdigit() or len(number) >= 10:
        return None
    return SamplerRef(model_id, source, int(number))


CHECKPOINT_KINDS = ("weights", "sampler_weights")  # a state (with the optimizer) | weights to sample from
CHECKPOINT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


@dataclass(frozen=True)
class TinkerPath:
    """`tinker://<model_id>/<kind>/<name>`: a run's named checkpoint."""

    model_id: str
    kind: str  # one of CHECKPOINT_KINDS
    name: str


def parse_tinker_path(path: str) -> TinkerPath | None:
    """The checkpoint `path` names, or None where it is not a tinker path."""
    if not path.startswith("tinker://"):
        return None
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in CHECKPOINT_KINDS or not re.match(CHECKPOINT_NAME, parts[2]) or not parts[0]:
        return None
    return TinkerPath(*parts)
