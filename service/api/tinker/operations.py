"""Storing a tinker operation, or a new run with its first operations, and telling a worker: the
future the SDK polls. Shared by the routes of every resource."""

from __future__ import annotations

from functools import partial

from fastapi import HTTPException

from service.api.tinker.schemas import UntypedFuture
from service.core import queue
from service.core.specs import HUB_NAMES, TERMINAL, LoraSpec, SessionJob
from service.core.tinker_requests import LoraConfigIn
from service.store import session_ops as ops_q
from service.store.db import after_commit, session_scope


def lora_spec(cfg: LoraConfigIn) -> LoraSpec:
    modules = ((["q_proj", "k_proj", "v_proj", "o_proj"] if cfg.train_attn else [])
               + (["gate_proj", "up_proj", "down_proj"] if cfg.train_mlp else [])
               + (["lm_head"] if cfg.train_unembed else []))
    return LoraSpec(r=cfg.rank, alpha=cfg.rank, target_modules=modules)  # alpha = r: the adapter's scale is 1


def owned_run(session, *, model_id: str, owner: str):
    job = ops_q.run_for_model(session, model_id=model_id, owner=owner)
    if job is None:  # another owner's run reads as missing
        raise HTTPException(404, f"model {model_id} not found")
    return job


def submit_op(settings, session, *, job, kind: str, body: bytes, seq: int | None) -> UntypedFuture:
    """The operation, and an idle run woken, in the caller's transaction on its one connection (a second
    connection taken while holding one starves the pool under concurrent requests); a worker is told once
    both are committed."""
    if job.status in TERMINAL:  # nothing will ever run it: refused, never stored as a future that cannot end
        raise HTTPException(409, f"model {job.uid} has ended ({job.status}): start a new training client",
                            headers={"x-should-retry": "false"})  # the SDK retries a 409 unless told not to
    if seq is not None and (op := ops_q.sent_before(session, job_id=job.id, kind=kind, body=body, seq=seq)):
        return UntypedFuture(request_id=op.request_id, model_id=job.uid)  # a retry: the same future, stored once
    op = ops_q.add_op(session, job=job, kind=kind, body=body, seq=seq)
    if (message := ops_q.wake(session, job_id=job.id)) is not None:
        after_commit(session, partial(_enqueue, settings, message))
    return UntypedFuture(request_id=op.request_id, model_id=job.uid)


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
        job = owned_run(session, model_id=model_id, owner=owner)
        return submit_op(settings, session, job=job, kind=kind, body=body, seq=seq)

