"""The tinker SDK's `sample` on the wire: what a request asks of its prompt and its completions, and
the protobuf `SampleResponse` that answers it. Numpy only, so the API checks a request with the same
code the worker runs it with.

A request can ask, besides the completions and each sampled token's log-prob:
- `prompt_logprobs`: each prompt token's log-prob given the tokens before it ([P], NaN where not
  scored: the first token, and those before the last `prompt_logprobs_last_n`);
- `topk_prompt_logprobs` / `topk_sample_logprobs`: the k most likely tokens at each prompt or sampled
  position, with their log-probs ([L, k]; unscored rows hold the SDK's sentinel);
- `target_prompt_logprobs`: the log-probs of named token ids, [P-1, K], cell [i, j] scored at prompt
  position i + 1, -1 naming nothing; dense or sparse CSR, answered in the same layout;
- `prompt_alt_tokens_k`: k draws, with replacement and at the request's temperature, at every prompt
  position after the first, with their log-probs ([P-1, k]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.tinker.requests import MAX_CELLS, MAX_K, SampleIn, TensorIn
from service.core.tinker.wire import WireError, pb

DEFAULT_MAX_TOKENS = 16  # a completion's length when sampling_params.max_tokens is not sent
MASK_LOGPROB = -99999.0  # the SDK's sentinel for a top-k row with nothing in it (token id 0)


@dataclass(frozen=True)
class TopK:
    """The k most likely tokens at each of L positions."""

    ids: np.ndarray  # [L, k] int32; 0 in rows not scored
    logprobs: np.ndarray  # [L, k] float32; MASK_LOGPROB in rows not scored


@dataclass(frozen=True)
class TargetIds:
    """`target_prompt_logprobs` as asked: dense ids, and the CSR layout when it came sparse (the
    answer goes back in the layout it came in)."""

    ids: np.ndarray  # [P-1, K] int64; -1: nothing asked
    crow: np.ndarray | None = None  # [P] int64, CSR row pointers
    col: np.ndarray | None = None  # [nnz] int64, CSR column indices

    @property
    def rows(self) -> np.ndarray:
        """[nnz] the row of each CSR value (CSR only)."""
        assert self.crow is not None, "rows of a dense ask"
        return np.repeat(np.arange(self.ids.shape[0]), np.diff(self.crow))

    @property
    def first_row(self) -> int:
        """The first row that names an id: rows before it need no scoring."""
        return int(np.flatnonzero((self.ids >= 0).any(axis=1))[0])


@dataclass(frozen=True)
class PromptScores:
    """What the prompt's forward pass answered; None where it was not asked."""

    logprobs: np.ndarray | None = None  # [P] float32, NaN where not scored
    topk: TopK | None = None  # [P, k]
    targets: np.ndarray | None = None  # [P-1, K] float32, 0.0 where nothing was asked
    alt_ids: np.ndarray | None = None  # [P-1, k] int64
    alt_logprobs: np.ndarray | None = None  # [P-1, k] float32


@dataclass(frozen=True)
class PromptAsk:
    """What one request asks of its prompt (P tokens)."""

    logprobs: bool = False  # each token's log-prob given those before it
    topk: int = 0  # the k likeliest tokens at each position
    last_n: int | None = None  # logprobs and topk for the last n tokens only; None: every token after the first
    targets: TargetIds | None = None  # [P-1, K] token ids whose log-probs to return
    alt_k: int = 0  # tokens drawn at each position after the first
    temperature: float = 1.0  # of the alternative draws (0: the argmax, k times)
    seed: int | None = None  # of the alternative draws

    @property
    def anything(self) -> bool:
        return self.logprobs or self.topk > 0 or self.targets is not None or self.alt_k > 0


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    topk: TopK | None = None  # [T, k] when topk_sample_logprobs was asked


def target_ids(sent: TensorIn, *, prompt_len: int, vocab_size: int | None = None) -> TargetIds:
    """`target_prompt_logprobs` as the SDK sends it in JSON (`data`, `dtype`, `shape`, and for CSR
    `sparse_crow_indices` / `sparse_col_indices`), checked against the prompt and the vocabulary."""
    where = "target_prompt_logprobs"
    if sent.dtype != "int64":
        raise WireError(f"{where}.dtype", "must be int64: token ids")
    shape = sent.shape
    if shape is None or len(shape) != 2:
        raise WireError(f"{where}.shape", f"must be 2-D, [len(prompt) - 1, K] = [{prompt_len - 1}, K]")
    rows, k = shape
    if rows != prompt_len - 1 or not 1 <= k or prompt_len * k > MAX_CELLS:
        raise WireError(f"{where}.shape", f"{shape}: must be [len(prompt) - 1, K] = [{prompt_len - 1}, K], K >= 1, "
                        f"len(prompt) * K at most {MAX_CELLS}")
    raw = np.asarray(sent.data, dtype=np.float64)
    if not (np.isfinite(raw) & (raw == np.round(raw))).all():
        raise WireError(f"{where}.data", "token ids must be whole numbers")
    data = raw.astype(np.int64)
    if (sent.sparse_crow_indices is None) != (sent.sparse_col_indices is None):
        raise WireError(f"{where}.sparse_col_indices", "sparse_crow_indices and sparse_col_indices go together")
    crow = col = None
    if sent.sparse_crow_indices is None or sent.sparse_col_indices is None:
        if data.size != rows * k:
            raise WireError(f"{where}.data", f"{data.size} values for shape {shape}")
        ids = data.reshape(rows, k)
    else:
        crow = np.asarray(sent.sparse_crow_indices, dtype=np.int64)
        col = np.asarray(sent.sparse_col_indices, dtype=np.int64)
        if (crow.size != rows + 1 or crow[0] != 0 or (np.diff(crow) < 0).any() or crow[-1] != col.size
                or col.size != data.size or ((col < 0) | (col >= k)).any()):
            raise WireError(f"{where}.sparse_crow_indices", f"not a CSR layout of shape {shape} with {data.size} "
                            "values")
        ids = np.full((rows, k), -1, dtype=np.int64)
        ids[TargetIds(ids, crow, col).rows, col] = data
    if (bad := ids[(ids < -1) | (ids >= (vocab_size or np.iinfo(np.int64).max))]).size:
        raise WireError(f"{where}.data", f"token id {int(bad[0])} is outside the model's vocabulary"
                        + (f" [0, {vocab_size})" if vocab_size else " (-1 names nothing)"))
    if not (ids >= 0).any():
        raise WireError(f"{where}.data", "names no token id (every cell is -1)")
    return TargetIds(ids, crow, col)


def check_widths(*, prompt_len: int, n: int, max_tokens: int, topk_prompt: int, topk_sample: int,
                 alt_k: int, last_n: int | None, prompt_logprobs: bool) -> None:
    """The sizes a sample request asks for, within what one answer may hold."""
    for name, k in (("topk_prompt_logprobs", topk_prompt), ("topk_sample_logprobs", topk_sample),
                    ("prompt_alt_tokens_k", alt_k)):
        if k > MAX_K:
            raise WireError(name, f"{k}: at most {MAX_K}")
    if prompt_len * max(topk_prompt, alt_k) > MAX_CELLS:
        raise WireError("topk_prompt_logprobs" if topk_prompt > alt_k else "prompt_alt_tokens_k",
                        f"len(prompt) * k is {prompt_len * max(topk_prompt, alt_k)}: at most {MAX_CELLS}")
    if n * max_tokens * topk_sample > MAX_CELLS:
        raise WireError("topk_sample_logprobs", f"num_samples * max_tokens * k is {n * max_tokens * topk_sample}: "
                        f"at most {MAX_CELLS}")
    if last_n is not None:
        if not prompt_logprobs:
            raise WireError("prompt_logprobs_last_n", "applies to prompt log-probs: set prompt_logprobs")
        if not 1 <= last_n <= prompt_len - 1:
            raise WireError("prompt_logprobs_last_n", f"{last_n}: must be between 1 and len(prompt) - 1 = "
                            f"{prompt_len - 1}")


def prompt_ask(req: SampleIn, *, prompt_len: int, vocab_size: int | None = None) -> PromptAsk:
    """What a sample request asks of its prompt, checked with the sizes it asks for itself. The API
    checks it without the vocabulary, the worker with it."""
    params = req.sampling_params
    check_widths(prompt_len=prompt_len, n=req.num_samples, max_tokens=params.max_tokens or DEFAULT_MAX_TOKENS,
                 topk_prompt=req.topk_prompt_logprobs, topk_sample=req.topk_sample_logprobs,
                 alt_k=req.prompt_alt_tokens_k, last_n=req.prompt_logprobs_last_n,
                 prompt_logprobs=bool(req.prompt_logprobs))
    targets = req.target_prompt_logprobs
    return PromptAsk(logprobs=bool(req.prompt_logprobs), topk=req.topk_prompt_logprobs,
                     last_n=req.prompt_logprobs_last_n, alt_k=req.prompt_alt_tokens_k,
                     targets=None if targets is None else target_ids(targets, prompt_len=prompt_len,
                                                                     vocab_size=vocab_size),
                     temperature=params.temperature, seed=params.seed)


def _topk(msg: Any, topk: TopK) -> None:
    msg.length, msg.k = topk.ids.shape
    msg.token_ids = np.ascontiguousarray(topk.ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(topk.logprobs, dtype=np.float32).tobytes()


def _tensor(msg: Any, values: np.ndarray, dtype: int) -> None:
    msg.dtype = dtype
    msg.shape.extend(values.shape)
    msg.dense = np.ascontiguousarray(values).tobytes()


def encode_sample_response(sequences: list[SampledSequence], prompt: PromptScores | None = None,
                           targets_as: TargetIds | None = None) -> bytes:
    """`SampleResponse` as the SDK decodes it: int32 tokens, float32 log-probs; a prompt log-prob of NaN
    reads as None. `targets_as`: the request's target ids, whose layout (dense or CSR) the answer keeps."""
    p = pb()
    out = p.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = p.STOP_REASON_STOP if s.stop_reason == "stop" else p.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
        if s.topk is not None:
            _topk(seq.topk_sampled_logprobs, s.topk)
    if prompt is None:
        return bytes(out.SerializeToString())
    if prompt.logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt.logprobs, dtype=np.float32).tobytes()
    if prompt.topk is not None:
        _topk(out.topk_prompt_logprobs, prompt.topk)
    if prompt.targets is not None:
        values = prompt.targets.astype(np.float32)
        if targets_as is not None and targets_as.crow is not None and targets_as.col is not None:
            t = out.target_prompt_logprobs
            t.dtype = p.DTYPE_FLOAT32
            t.shape.extend(values.shape)
            t.sparse_csr.values = np.ascontiguousarray(values[targets_as.rows, targets_as.col]).tobytes()
            t.sparse_csr.crow_indices = targets_as.crow.astype(np.int64).tobytes()
            t.sparse_csr.col_indices = targets_as.col.astype(np.int64).tobytes()
        else:
            _tensor(out.target_prompt_logprobs, values, p.DTYPE_FLOAT32)
    if prompt.alt_ids is not None and prompt.alt_logprobs is not None:  # asked together, set together
        _tensor(out.prompt_alt_tokens.tokens, prompt.alt_ids.astype(np.int64), p.DTYPE_INT64)
        _tensor(out.prompt_alt_tokens.logprobs, prompt.alt_logprobs.astype(np.float32), p.DTYPE_FLOAT32)
    return bytes(out.SerializeToString())


def _topk_json(msg: Any) -> list[list[list[float]] | None] | None:
    """[length][k] of [token id, log-prob] (the SDK's JSON form), a position with none (all MASK_LOGPROB)
    as None; None where the answer has none."""
    if not msg.length:
        return None
    ids = np.frombuffer(msg.token_ids, dtype=np.int32).reshape(msg.length, msg.k)
    logprobs = np.frombuffer(msg.logprobs, dtype=np.float32).reshape(msg.length, msg.k)
    return [None if (row_lps == MASK_LOGPROB).all() else
            [[int(i), float(lp)] for i, lp in zip(row_ids, row_lps, strict=True)]
            for row_ids, row_lps in zip(ids, logprobs, strict=True)]


def _tensor_json(msg: Any) -> dict[str, Any]:
    """A `TensorData` as the SDK's JSON sends it: flat values, dense or sparse CSR."""
    p = pb()
    dtype = np.float32 if msg.dtype == p.DTYPE_FLOAT32 else np.int64
    name = "float32" if dtype is np.float32 else "int64"
    if msg.HasField("sparse_csr"):
        return {"data": np.frombuffer(msg.sparse_csr.values, dtype=dtype).tolist(), "dtype": name,
                "shape": list(msg.shape),
                "sparse_crow_indices": np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64).tolist(),
                "sparse_col_indices": np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64).tolist()}
    return {"data": np.frombuffer(msg.dense, dtype=dtype).tolist(), "dtype": name, "shape": list(msg.shape)}


def _floats(raw: bytes) -> list[float | None]:
    return [None if np.isnan(v) else float(v) for v in np.frombuffer(raw, dtype=np.float32)]


def sample_response_json(body: bytes) -> dict[str, Any]:
    """A stored `SampleResponse` in the SDK's JSON form, for a client that did not ask for protobuf."""
    p = pb()
    msg = p.SampleResponse()
    msg.ParseFromString(body)
    out: dict[str, Any] = {"type": "sample", "sequences": [
        {"stop_reason": "stop" if s.stop_reason == p.STOP_REASON_STOP else "length",
         "tokens": np.frombuffer(s.tokens, dtype=np.int32).tolist(), "logprobs": _floats(s.logprobs),
         "topk_logprobs": _topk_json(s.topk_sampled_logprobs)} for s in msg.sequences]}
    if msg.prompt_logprobs:
        out["prompt_logprobs"] = _floats(msg.prompt_logprobs)
    if (topk := _topk_json(msg.topk_prompt_logprobs)) is not None:
        out["topk_prompt_logprobs"] = topk
    if msg.HasField("target_prompt_logprobs"):
        out["target_prompt_logprobs"] = _tensor_json(msg.target_prompt_logprobs)
    if msg.HasField("prompt_alt_tokens"):
        out["prompt_alt_tokens"] = {"tokens": _tensor_json(msg.prompt_alt_tokens.tokens),
                                    "logprobs": _tensor_json(msg.prompt_alt_tokens.logprobs)}
    return out
