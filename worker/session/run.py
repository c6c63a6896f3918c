"""A session run: the client's own loop, driven one operation at a time through the tinker SDK.

Variant: no loop of ours. The worker holding the run loads the model once (a LoRA adapter of the
rank `create_model` asked for, or the whole model) and an AdamW optimizer, then runs the run's
pending operations in the order the client sent them (`seq`), writing each result for the future
the client polls:

  create_model      -> {"model_id"}: the model is loaded (or restored from the run's last state)
  forward_backward  -> per-datum `logprobs` and `loss:sum`; gradients add up until optim_step (the
                       data run as padded batches of up to FORWARD_TOKENS tokens)
  forward           -> the same without gradients
  optim_step        -> one AdamW step with the hyper-parameters sent, then gradients are cleared
  save_weights_for_sampler (no name) -> a sampling session on a snapshot of the weights as they are
  sample            -> n completions of a prompt from a snapshot's weights, with the log-prob of every
                       sampled token (and of the prompt's, when asked); the pending sample calls run as
                       one batch, and their completions are recorded as the samples of the current step
  save_weights      -> the state (weights and optimizer) saved as checkpoint step-N, named
                       `tinker://<model_id>/weights/<name>` (or `sampler_weights/<name>`)
  load_weights      -> a named checkpoint's weights (and its optimizer state, when asked) loaded

Every optim_step is a step of the run: it records `loss/total` (the sum of its forward_backwards'
losses), `tokens`, `lr`, `grad_norm` and `time/step_s`. With no operation for
`session.idle_timeout_s` the run's state (weights and optimizer) is saved and the worker gives the run
back (status idle); the next operation queues it again and a worker restores that state. A worker told
to stop (worker.session.stopping) does the same at the run's next clean point (no gradient waiting for its
optim_step), and the run is queued again at once if operations are pending. Gradients
accumulated by a forward_backward whose optim_step has not come yet are not part of the saved state, nor
are the in-memory snapshots of older weights: a sampler of the current weights samples on, one of older
weights is told they are no longer kept.

A run create_sampling_session made for a base model, or for a path whose run has ended
(`session.sampling_only`), only samples those weights (the path's through `model.init_from`).
Snapshots and sampling: worker.session.sampling.

Run it from the SDK: docs/guide/tinker.md.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import torch

from service.core.records import OpResult
from service.core.settings import Settings
from service.core.specs import SessionJob
from service.core.tinker.requests import LoadWeightsOp, OptimStepIn, SaveNamedOp
from service.core.tinker.wire import (
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    tinker_path,
)
from worker.algos import tinker_losses
from worker.loops.setup import init_weights
from worker.loops.update import clip_and_step
from worker.model.checkpoints import load_checkpoint, load_weights, save_checkpoint
from worker.model.loading import load_policy
from worker.parallel.distributed import Ranks
from worker.parallel.launch import place, visible_gpus
from worker.reporting import LeaseLost, LoopResult, Reporter
from worker.session.sampling import gather_samples, run_samples, save_for_sampler
from worker.session.state import Session
from worker.session.stopping import stopping
from worker.training import NonFiniteUpdate, trainable

log = logging.getLogger(__name__)
# Between looks for the next operation: every 2 ms for a second after the last one (a client's loop
# sends the next at once; measured in bench/primitives.py), then every 50 ms.
POLL_BUSY_S, POLL_IDLE_S, BUSY_FOR_S = 0.002, 0.05, 1.0


def datum_loss(name: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor],
               config: dict[str, float]) -> torch.Tensor:
    """The built-in loss `name` of one datum; `logp` [N] the policy's log-probs of its target tokens."""
    if name == "cross_entropy":
        return tinker_losses.cross_entropy(logp, weights=inputs.get("weights", torch.ones_like(logp)))
    q, adv = inputs["logprobs"], inputs["advantages"]
    if name == "importance_sampling":
        return tinker_losses.importance_sampling(logp, q=q, adv=adv)
    if name == "dro":
        return tinker_losses.dro(logp, q=q, adv=adv, beta=config["beta"])
    clip = {"clip_low": config["clip_low_threshold"], "clip_high": config["clip_high_threshold"]}
    if name == "gspo":
        return tinker_losses.gspo(logp, q=q, adv=adv, sequence_mask=inputs.get("sequence_ratio_mask"), **clip)
    return {"ppo": tinker_losses.ppo, "cispo": tinker_losses.cispo}[name](logp, q=q, adv=adv, **clip)


# Padded tokens per forward pass (its logits are FORWARD_TOKENS x vocabulary floats). On this 2-core
# CPU, SmolLM2 LoRA, 32 sequences of 45 tokens: 23.8 s one by one, 9.2 s in batches of 1024 tokens;
# 8 of 200-950 tokens: 41.8 s one by one, 39.8 s at 1024, 55.2 s at 2048, 72.6 s at 4096.
FORWARD_TOKENS = 1024


def length_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of sequences grouped shortest first, each group's rows x longest length within
    `max_tokens` (a longer sequence goes alone). A tinker datum is one sequence of any length, padded
    on the right: sorting by length wastes the least padding. (A rollout batch keeps its rows' order
    and prompt/completion split: worker/sampling.micro_batches.)"""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def forward_backward(s: Session, body: bytes) -> bytes:
    request = decode_forward_backward(body, vocab_size=s.vocab_size, context=s.context)
    device = next(s.model.parameters()).device
    logps: list[np.ndarray | None] = [None] * len(request.data)
    total = 0.0
    for group in length_groups([len(d.tokens) for d in request.data], FORWARD_TOKENS):
        data = [request.data[i] for i in group]
        width = max(len(d.tokens) for d in data)
        ids = torch.zeros(len(data), width, dtype=torch.long, device=device)  # [B, W] padded on the right
        mask = torch.zeros_like(ids)  # [B, W]
        for row, d in enumerate(data):
            ids[row, :len(d.tokens)] = torch.from_numpy(d.tokens)
            mask[row, :len(d.tokens)] = 1
        with torch.set_grad_enabled(not request.forward_only):
            logits = s.model(input_ids=ids, attention_mask=mask).logits  # [B, W, V]
            losses = []
            for row, (i, d) in enumerate(zip(group, data, strict=True)):
                inputs = {k: torch.tensor(v, dtype=torch.float32 if v.dtype.kind == "f" else torch.int64,
                                          device=device) for k, v in d.inputs.items()}
                logp = torch.log_softmax(logits[row, :len(d.tokens)].float(), dim=-1).gather(
                    -1, inputs["target_tokens"][:, None])[:, 0]  # [N]
                losses.append(datum_loss(request.loss_fn, logp, inputs, request.config))
                logps[i] = logp.detach().cpu().numpy()
            loss = torch.stack(losses).sum()
            if not request.forward_only:
                loss.backward()
        total += loss.item()
    if not request.forward_only:
        s.pending["loss"] += total
        s.pending["tokens"] += request.tokens
    return encode_forward_backward_output([{"logprobs": lp} for lp in logps], {"loss:sum": total})


def optim_step(s: Session, body: bytes, reporter: Reporter) -> bytes:
    adam = OptimStepIn.model_validate_json(body).adam_params  # as the API validated it, with its defaults
    lr = adam.learning_rate
    for group in s.optimizer.param_groups:
        group.update(lr=lr, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay)
    try:
        norm = clip_and_step(s.params, s.optimizer, None, max_norm=adam.grad_clip_norm or None, ranks=Ranks())
    except NonFiniteUpdate as exc:  # nothing applied: the gradients that carry it are dropped, the weights kept
        s.optimizer.zero_grad(set_to_none=True)
        s.pending = {"loss": 0.0, "tokens": 0.0}
        raise WireError("adam_params", f"{exc}: nothing was applied, and the gradients accumulated since the "
                        "last optim_step were dropped") from None
    s.optimizer.zero_grad(set_to_none=True)
    s.step += 1
    s.version += 1
    metrics = {"loss/total": s.pending["loss"], "tokens": s.pending["tokens"], "lr": lr, "grad_norm": norm,
               "time/step_s": time.monotonic() - s.step_started}
    reporter.metrics(s.step, metrics)
    reporter.progress(s.step)
    s.pending = {"loss": 0.0, "tokens": 0.0}
    s.step_started = time.monotonic()
    return json.dumps({"type": "optim_step", "metrics": {"grad_norm:mean": norm, "learning_rate:mean": lr}}).encode()


# After a worker is lost, the run's weight versions go on from its saved one plus this: the versions
# the lost worker handed out since (fewer than this many weight changes) are never named again.
VERSION_GAP = 1 << 20


def save_named(s: Session, body: bytes, reporter: Reporter, model_id: str) -> bytes:
    req = SaveNamedOp.model_validate_json(body)
    save_state(s, reporter, f"saved as {req.kind}/{req.name}")
    reporter.operations().name_checkpoint(req.kind, req.name, s.step)
    kind = "save_weights" if req.kind == "weights" else "save_weights_for_sampler"
    return json.dumps({"type": kind, "path": tinker_path(model_id, req.kind, req.name)}).encode()


def load_named(s: Session, body: bytes, reporter: Reporter, model_id: str) -> bytes:
    """A checkpoint's weights, and its optimizer state when asked; the run keeps its own step count."""
    req = LoadWeightsOp.model_validate_json(body)
    folder = reporter.init_checkpoint(req.job, req.step).path
    s.optimizer.zero_grad(set_to_none=True)  # gradients of the weights being replaced mean nothing now
    if req.optimizer:
        step = s.step
        load_checkpoint(folder, s.trainables())
        s.step = step
    else:
        load_weights(folder, model=s.model)
    s.version += 1
    s.saved_step = None  # the saved state of this step is not these weights
    reporter.event("loaded", f"loaded {req.path}" + (" with its optimizer state" if req.optimizer else ""),
                   data={"path": req.path, "optimizer": req.optimizer})
    return json.dumps({"type": "load_weights", "path": req.path, "model_id": model_id}).encode()


def _refuse_training(body: bytes) -> tuple[bytes, str]:
    raise WireError("model_id", "this run samples a base model (create_sampling_session): it does not train")


def save_state(s: Session, reporter: Reporter, why: str) -> None:
    """The run's weights and optimizer as checkpoint step-N, unless step N is saved already (or the run
    only samples a base model: nothing of it changes)."""
    if s.saved_step == s.step or not s.trains:
        return
    path = reporter.checkpoint_dir(s.step)
    s.snapshots.pop(f"s{s.step}", None)  # a step saved again (after a load_weights) holds other weights
    saved = save_checkpoint(path, s.trainables(), step=s.step, opt_steps=s.step, extra={"version": s.version})
    reporter.checkpoint(s.step, path, saved.format, saved.size_bytes)
    reporter.event("checkpoint", f"state saved at step {s.step} ({why})", data={"step": s.step, "format": saved.format})
    s.saved_step = s.step


def load(spec: SessionJob, settings: Settings, reporter: Reporter) -> Session:
    seed = spec.session.seed if spec.session.seed is not None else int(torch.seed() % 2**32)
    device = place(spec.devices.policy, visible_gpus())
    model, tokenizer = load_policy(spec.model, models_root=settings.models_dir, device=device, seed=seed,
                                   model_roots=settings.model_roots)
    init_weights(model, spec.model.init_from, reporter)  # a sampler of a path whose run has ended
    params = trainable(model)
    s = Session(model=model, tokenizer=tokenizer, optimizer=torch.optim.AdamW(params, lr=1e-4), params=params,
                vocab_size=model.get_input_embeddings().num_embeddings, trains=not spec.session.sampling_only,
                context=getattr(model.config, "max_position_embeddings", None))
    if (path := reporter.resume_from()) is not None:
        restored = load_checkpoint(path, s.trainables())
        s.step = s.saved_step = restored.step
        s.version = restored.extra.get("version", 0)  # a sampler of these weights samples them still
        reporter.event("resumed", f"state restored from step {s.step}", data={"step": s.step})
    if reporter.attempt > 1:  # the worker before stopped without giving the run back: what it did since is lost
        # versions it handed out since the saved state name weights that are gone: never reuse them
        s.version += VERSION_GAP
        since = f"its state saved at step {s.step}" if s.saved_step is not None else "its initial weights (no state " \
            "was saved yet)"
        reporter.operations().fail_pending(
            f"the worker running this session stopped (killed or cut off); the run resumed on another worker from "
            f"{since}, so what was sent after that is lost: send it again from there", "server")
        reporter.event("resumed_after_failure", f"attempt {reporter.attempt}: pending operations failed; state "
                       f"from step {s.step}", level="warning", data={"step": s.step})
    model.train()
    return s


def run(spec: SessionJob, reporter: Reporter, *, settings: Settings, ranks=None) -> LoopResult:
    try:
        return serve(spec, reporter, settings)
    except LeaseLost:  # another worker takes the run over and runs what is pending
        raise
    except Exception as exc:  # the run fails: so do the futures waiting on it, with the reason
        reporter.operations().fail_pending(f"the session run failed: {type(exc).__name__}: {exc}", "server")
        raise


def serve(spec: SessionJob, reporter: Reporter, settings: Settings) -> LoopResult:
    ops = reporter.operations()
    s = load(spec, settings, reporter)
    handlers = {"forward_backward": lambda body: (forward_backward(s, body), "proto"),
                "optim_step": lambda body: (optim_step(s, body, reporter), "json"),
                "create_model": lambda body: (json.dumps({"type": "create_model", "model_id": body.decode()}).encode(),
                                              "json"),
                "save_weights_for_sampler": lambda body: (save_for_sampler(s, body, spec.session.model_id), "json"),
                "save_weights": lambda body: (save_named(s, body, reporter, spec.session.model_id), "json"),
                "load_weights": lambda body: (load_named(s, body, reporter, spec.session.model_id), "json")}
    if spec.session.sampling_only:  # a base model's sampler: nothing else is sent to it by the SDK
        handlers = {kind: handler if kind == "create_model" else _refuse_training for kind, handler in handlers.items()}
    last_op = last_save = time.monotonic()
    last_batch = 0  # sample operations in the last batch sampled
    while True:
        if reporter.should_stop():
            save_state(s, reporter, "cancelled")
            ops.fail_pending("the run was cancelled", "user")
            return LoopResult(status="cancelled", step=s.step)
        if stopping() and not s.pending["tokens"]:  # at a clean point: no gradient waits for its optim_step
            save_state(s, reporter, "the worker is stopping")
            return LoopResult(status="idle", step=s.step, why="its worker is stopping")
        op = ops.next()
        if op is None:
            if time.monotonic() - last_op > spec.session.idle_timeout_s:
                save_state(s, reporter, f"no operation for {spec.session.idle_timeout_s:g} s")
                return LoopResult(status="idle", step=s.step, why="no operation for a while")
            time.sleep(POLL_BUSY_S if time.monotonic() - last_op < BUSY_FOR_S else POLL_IDLE_S)
            continue
        if op.kind == "sample":
            batch = gather_samples(ops, last_batch)
            run_samples(s, ops, batch, reporter, batch_tokens=settings.sample_batch_tokens)
            last_batch = len(batch)
            last_op = time.monotonic()
            continue
        try:
            result, fmt = handlers[op.kind](op.body)
        except WireError as exc:
            ops.fail(op, str(exc), "user")
        except Exception as exc:  # the run goes on; the client sees why this operation failed
            log.exception("session run %s: %s failed", reporter.job_id, op.kind)
            ops.fail(op, f"{op.kind} failed: {type(exc).__name__}: {exc}", "server")
        else:
            if op.kind == "optim_step" and time.monotonic() - last_save >= settings.session_save_every_s:
                save_state(s, reporter, "autosave")  # before its future completes: what a client saw is kept
                last_save = time.monotonic()
            ops.complete([OpResult(op, result, fmt)])
        last_op = time.monotonic()
