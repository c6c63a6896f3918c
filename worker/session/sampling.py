"""A session run's sampling: snapshots of its weights, and the `sample` operations run as batches.

save_weights_for_sampler (no name) keeps a snapshot of the trained weights as they are (the
SNAPSHOTS_KEPT newest); a `sample` names the weights it samples by its sampling session id: the run's
current ones, a snapshot, or a saved checkpoint (`tinker://` path). The sample operations at the head of
the run's queue are gathered while more keep arriving, sampled together (worker.session.token_sampler), and
their completions recorded as the samples of the run's current step.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from service.core.records import OpResult, PendingOp, SampleRow, Samples
from service.core.tinker.requests import SampleIn
from service.core.tinker.sampling import (
    DEFAULT_MAX_TOKENS,
    PromptAsk,
    SampledSequence,
    encode_sample_response,
    prompt_ask,
)
from service.core.tinker.wire import SamplerRef, WireError, parse_sampler_id, sampler_id
from worker.engines.hf_engine import eos_token_ids
from worker.machine.allocator import release_freed_memory
from worker.model.checkpoints import load_weights
from worker.reporting import Operations, Reporter
from worker.session import token_sampler
from worker.session.prompt_scoring import score_prompt
from worker.session.state import Session
from worker.training import eval_mode

log = logging.getLogger(__name__)

SNAPSHOTS_KEPT = 4  # sampling snapshots kept in memory: the newest ones, and the saved weights last sampled


def trained_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the trained weights (the adapter's, or the whole model's), on the CPU."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def save_for_sampler(s: Session, body: bytes, model_id: str) -> bytes:
    """A snapshot of the trained weights as they are now, for a sampling client to sample from while
    training goes on (a named save goes through save_named)."""
    if f"v{s.version}" not in s.snapshots:
        s.snapshots[f"v{s.version}"] = trained_weights(s.model)
        for old in sorted((k for k in s.snapshots if k[0] == "v"), key=lambda k: int(k[1:]))[:-SNAPSHOTS_KEPT]:
            del s.snapshots[old]
    return json.dumps({"type": "save_weights_for_sampler",
                       "sampling_session_id": sampler_id(model_id, s.version)}).encode()


def saved_weights(s: Session, step: int, reporter: Reporter) -> dict[str, torch.Tensor]:
    """The trained weights of the run's checkpoint at `step` (what a tinker:// path names), kept as a
    snapshot once read."""
    key = f"s{step}"
    if key not in s.snapshots:
        folder = reporter.init_checkpoint(reporter.job_id, step).path
        current = trained_weights(s.model)
        load_weights(folder, model=s.model)
        s.snapshots[key] = trained_weights(s.model)
        put_weights(s.model, current)
        for old in [k for k in s.snapshots if k[0] == "s"][:-SNAPSHOTS_KEPT]:
            del s.snapshots[old]
    return s.snapshots[key]


def put_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(weights[n])


@contextmanager
def weights_of(s: Session, ref: SamplerRef, reporter: Reporter):
    """The model with the weights a sampling session names: the current ones, or a snapshot (or a saved
    checkpoint's) swapped in and out again."""
    if ref.source == "v" and ref.number == s.version:
        yield s.model
        return
    weights = s.snapshots[ref.key] if ref.source == "v" else saved_weights(s, ref.number, reporter)
    current = trained_weights(s.model)
    put_weights(s.model, weights)
    try:
        yield s.model
    finally:
        put_weights(s.model, current)


@dataclass(frozen=True)
class SampleCall:
    """One `sample` operation, parsed: n completions of a prompt from the weights `ref` names."""

    sampler: str  # the sampling session id, recorded with the samples
    ref: SamplerRef
    request: token_sampler.Request
    prompt: PromptAsk  # what it asks of its prompt


def parse_sample(s: Session, body: bytes) -> SampleCall:
    req = SampleIn.model_validate_json(body)  # as the API validated it
    prompt = [t for chunk in req.prompt.chunks for t in chunk.tokens]
    params = req.sampling_params
    if bad := [t for t in prompt if not 0 <= t < s.vocab_size]:
        raise WireError("prompt", f"token id {bad[0]} is outside the model's vocabulary [0, {s.vocab_size})")
    stop = params.stop
    stop_tokens: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    if stop is None:  # the model's end-of-sequence tokens
        stop_tokens = frozenset(eos_token_ids(s.tokenizer, s.model))
    elif isinstance(stop, str):
        stop_strings = (stop,)
    elif all(isinstance(x, int) for x in stop):
        stop_tokens = frozenset(x for x in stop if isinstance(x, int))
    else:
        stop_strings = tuple(x for x in stop if isinstance(x, str))
    p = token_sampler.Params(max_tokens=params.max_tokens or DEFAULT_MAX_TOKENS, temperature=params.temperature,
                             top_k=params.top_k, top_p=params.top_p, seed=params.seed, stop_tokens=stop_tokens,
                             stop_strings=stop_strings, topk_logprobs=req.topk_sample_logprobs)
    if s.context is not None and len(prompt) + p.max_tokens > s.context:  # positions the model has no embedding for
        raise WireError("sampling_params.max_tokens", f"{len(prompt)} prompt tokens + max_tokens {p.max_tokens} is "
                        f"over the model's context of {s.context}")
    ask = prompt_ask(req, prompt_len=len(prompt), vocab_size=s.vocab_size)
    ref = parse_sampler_id(req.sampling_session_id)
    if ref.source == "v" and ref.number != s.version and ref.key not in s.snapshots:
        raise WireError("sampling_session_id", f"the weights of version {ref.number} are no longer kept (the "
                        f"{SNAPSHOTS_KEPT} newest snapshots are): save_weights_and_get_sampling_client again")
    return SampleCall(req.sampling_session_id, ref, token_sampler.Request(prompt, req.num_samples, p), ask)


SAMPLE_BATCH_ROWS = 64  # completions sampled in one batch at most (rows of several pending sample requests)


@dataclass(frozen=True)
class SampleResult:
    response: bytes  # the SampleResponse for the client
    rows: list[SampleRow]  # the completions as text, for the run's samples


@dataclass(frozen=True)
class Part:
    """Rows of one call sampled in one batch: a call whose rows do not fit one batch is split in parts."""

    call: int  # its index in the calls
    request: token_sampler.Request  # n: this part's rows; its stream is the call's, shared by its parts


def batches(calls: list[SampleCall], indices: list[int], *, batch_tokens: int,
            device: torch.device | str = "cpu") -> list[list[Part]]:
    """The rows of `calls[indices]`, in order, as batches of at most SAMPLE_BATCH_ROWS rows and
    `batch_tokens` positions (rows x their longest prompt + max_tokens); a call's rows split across
    batches where they must (one row at least in each)."""
    out: list[list[Part]] = []
    batch: list[Part] = []
    rows = width = 0
    for i in indices:
        r = calls[i].request
        # on the model's device: multinomial draws with a generator of the device it samples on
        stream = token_sampler.generator(r.params.seed, device) if r.stream is None else r.stream
        left, size = r.n, len(r.prompt) + r.params.max_tokens
        while left:
            w = max(width, size)
            fit = min(left, SAMPLE_BATCH_ROWS - rows, batch_tokens // w - rows)
            if fit <= 0 and batch:  # the batch is full: this call's rows start the next one
                out.append(batch)
                batch, rows, width = [], 0, 0
                continue
            fit = max(fit, 1)  # a row longer than the budget still runs, alone
            batch.append(Part(i, replace(r, n=fit, stream=stream)))
            rows, width, left = rows + fit, w, left - fit
    if batch:
        out.append(batch)
    return out


def sample(s: Session, calls: list[SampleCall], reporter: Reporter, *, batch_tokens: int) -> list[SampleResult]:
    """The results of sample calls, in their order: the calls of one snapshot run as batches (`batches`);
    what a batch took is handed back to the OS after it."""
    results: list[SampleResult | None] = [None] * len(calls)
    for ref in dict.fromkeys(c.ref for c in calls):
        mine = [i for i, c in enumerate(calls) if c.ref == ref]
        rows: dict[int, list[token_sampler.Sampled]] = {i: [] for i in mine}
        with weights_of(s, ref, reporter) as model, eval_mode(model):
            device = next(model.parameters()).device
            for batch in batches(calls, mine, batch_tokens=batch_tokens, device=device):
                sampled = token_sampler.sample_many(model, [p.request for p in batch], s.tokenizer.decode)
                for part, part_rows in zip(batch, sampled, strict=True):
                    rows[part.call] += part_rows
                del sampled
                release_freed_memory()
            for i in mine:
                c = calls[i]
                scores = score_prompt(model, c.request.prompt, c.prompt) if c.prompt.anything else None
                response = encode_sample_response([SampledSequence(r.tokens, r.logprobs, r.stop_reason, r.topk)
                                                   for r in rows[i]], scores, c.prompt.targets)
                results[i] = SampleResult(response, sample_rows(s, c, rows[i]))
    return results


def sample_rows(s: Session, call: SampleCall, rows: list[token_sampler.Sampled]) -> list[SampleRow]:
    """A call's completions as the run records them: text, and no reward (the client grades them)."""
    prompt = s.tokenizer.decode(call.request.prompt)
    return [SampleRow(index=i, prompt=prompt, completion=s.tokenizer.decode(r.tokens), reward=None, advantage=None,
                      extra={"sampler": call.sampler, "tokens": len(r.tokens), "logprob": sum(r.logprobs),
                             "stop_reason": r.stop_reason}) for i, r in enumerate(rows)]


# A client sends a step's sample requests together, and they reach the store over a few hundred ms
# (measured: 16 requests of the cookbook's RL loop within 300 ms, up to 80 ms apart). A decode step
# costs about the same for 1 row as for 16 (it reads every weight either way), so while more keep
# arriving (within GATHER_S of the last, for GATHER_MAX_S at most) they are gathered into one batch.
# A client that sends one request at a time (one pending now, one in the batch before) does not wait.
GATHER_S, GATHER_MAX_S = 0.1, 0.5


def gather_samples(ops: Operations, last_batch: int) -> list[PendingOp]:
    """The sample operations at the head of the queue, waiting for more while they keep coming;
    `last_batch`: how many the batch before had."""
    run = ops.next_run("sample", SAMPLE_BATCH_ROWS)
    if len(run) == 1 and last_batch <= 1:
        return run
    deadline = time.monotonic() + GATHER_MAX_S
    while len(run) < SAMPLE_BATCH_ROWS and time.monotonic() < deadline:
        time.sleep(GATHER_S)
        more = ops.next_run("sample", SAMPLE_BATCH_ROWS)
        if len(more) == len(run):
            break
        run = more
    return run


def run_samples(s: Session, ops: Operations, pending: list[PendingOp], reporter: Reporter, *,
                batch_tokens: int) -> None:
    """Sample operations, run as batches; one that is malformed fails alone."""
    calls: list[tuple[PendingOp, SampleCall]] = []
    for op in pending:
        try:
            calls.append((op, parse_sample(s, op.body)))
        except WireError as exc:
            ops.fail(op, str(exc), "user")
    try:
        results = sample(s, [call for _, call in calls], reporter, batch_tokens=batch_tokens)
    except Exception as exc:  # the run goes on; each client sees why its sample failed
        log.exception("session run: sampling %d requests failed", len(calls))
        for op, _ in calls:
            ops.fail(op, f"sample failed: {type(exc).__name__}: {exc}", "server")
        return
    ops.complete([OpResult(op, result.response, "proto", Samples(step=s.step, rows=result.rows))
                  for (op, _), result in zip(calls, results, strict=True)])
