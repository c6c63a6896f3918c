"""Storing a tinker operation, or a new run with its first operations, and telling a worker: the
future the SDK polls. Shared by the routes of every resource."""

from __future__ import annotations

from functools import partial

from fastapi import HTTPException

from service.api.tinker.schemas import UntypedFuture
from service.core import queue
from service.core.specs import HUB_NAMES, TERMINAL, LoraSpec, SessionJob
from service.core.tinker.requests import LoraConfigIn
from service.store import session_ops as ops_q
from service.store.db import after_commit, session_scope


def lora_spec(cfg: LoraConfigIn) -> LoraSpec:
    modules = ((["q_proj", "k_proj", "v_proj", "o_proj"] if cfg.train_attn else [])
               + (["gate_proj", "up_proj", "down_proj"] if cfg.train_mlp else [])
               + (["lm_head"] if cfg.train_unembed else []))
    return LoraSpec(r=cfg.rank, alpha=cfg.rank, target_modules=modules)  # alpha = r: the adapter's scale is 1


def owned_run(session, *, model_id: str, owner: str, for_update: bool = False):
    """The run `model_id` names, if `owner`'s. `for_update` locks its row until the caller commits, so an
    operation stored with it and a cancel of the run are ordered: the operation is failed by the cancel, or
    refused after it, never left pending for a worker to run."""
    job = ops_q.run_for_model(session, model_id=model_id, owner=owner, for_update=for_update)
    if job is None:  # another owner's run reads as missing
        raise HTTPException(404, f"model {model_id} not found")
    return job


def submit_op(settings, session, *, job, kind: str, body: bytes, seq: int | None) -> UntypedFuture:
    """The operation, and an idle run woken, in the caller's transaction on its one connection (a second
    connection taken while holding one starves the pool under concurrent requests); a worker is told once
    both are committed."""
    if seq is not None and (op := ops_q.sent_before(session, job_id=job.id, kind=kind, body=body, seq=seq)):
        return UntypedFuture(request_id=op.request_id, model_id=job.uid)  # a retry: the same future, stored once
    if (why := ended(job)) is not None:
        # Nothing will ever run it. Answered with a future that has already failed, not a 409: the pinned SDK
        # retries every 409 for five minutes whatever x-should-retry says, and raises on a failed future at once.
        op = ops_q.add_refused(session, job=job, kind=kind, seq=seq, error=why)
        return UntypedFuture(request_id=op.request_id, model_id=job.uid)
    op = ops_q.add_op(session, job=job, kind=kind, body=body, seq=seq)
    if (message := ops_q.wake(session, job_id=job.id)) is not None:
        after_commit(session, partial(_enqueue, settings, message))
    return UntypedFuture(request_id=op.request_id, model_id=job.uid)


def ended(job) -> str | None:
    """Why `job` takes no new operation, or None while it does: it has ended, or a cancel was accepted."""
    if job.status in TERMINAL:
        return f"model {job.uid} has ended ({job.status}): start a new training client"
    if job.cancel_requested:
        return f"model {job.uid} was cancelled: start a new training client"
    return None


def _enqueue(settings, message: queue.Message) -> None:
    """Tell a worker, once the run and its operation are committed. With the broker down the answer is still
    the stored operation's future, never a 5xx: the SDK retries a 5xx, and a retry would store the operation
    (or the run) again. The run goes back to idle and the sweep queues it once the broker answers."""
    try:
        queue.enqueue(message, broker_url=settings.broker)
    except Exception as exc:  # any transport error: the operation is stored, the sweep delivers it
        with session_scope(settings.store_url) as session:
            ops_q.unwake(session, job_id=message.job_id, why=f"the broker was unreachable ({type(exc).__name__})")


def start_run(settings, session, *, owner: str, spec: SessionJob,
               then: tuple[str, bytes] | None = None) -> UntypedFuture:
    """A new session run, queued with its `create_model` operation (and `then`, an operation after it):
    the future of the last. create_model, a run from a saved state and a base model's sampler start so."""
    job = ops_q.create_run(session, owner=owner, spec=spec)
    op = ops_q.add_op(session, job=job, kind="create_model", body=job.uid.encode(), seq=0)
    if then is not None:
        op = ops_q.add_op(session, job=job, kind=then[0], body=then[1], seq=1)
    after_commit(session, partial(_enqueue, settings, queue.Message(job.id, job.uid, job.gpus)))  # once they exist
    return UntypedFuture(request_id=op.request_id, model_id=job.uid)


def service_model_name(base_model: str) -> str:
    """The service's name of a model the SDK names by its hub name."""
    return {hub: name for name, hub in HUB_NAMES.items()}.get(base_model, base_model)



def queue_op(settings, owner: str, model_id: str, kind: str, body: bytes, seq: int | None) -> UntypedFuture:
    with session_scope(settings.store_url) as session:
        job = owned_run(session, model_id=model_id, owner=owner, for_update=True)
        return submit_op(settings, session, job=job, kind=kind, body=body, seq=seq)

