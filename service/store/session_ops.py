"""The tinker-compatible API's rows: client sessions, session runs (jobs of kind `session`) and the
operations a client sends them, which are the futures it polls.

An operation is `pending` until the worker holding its run writes its result (`done`) or its error
(`failed`). A run no worker holds is `idle`; the first operation sent to it queues it again (`wake`),
and a run's worker gives it back (`give_back`) as idle only while it has nothing pending, else queued
again, so an operation is never left without a worker; the sweep wakes an idle run that still has
one (a race of the two the store's isolation level allows).
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from itertools import takewhile
from typing import Literal

from sqlalchemy import case, exists, func, select, update
from sqlalchemy.orm import Session

from service.core.queue import Message
from service.core.records import OpResult, PendingOp
from service.core.specs import TERMINAL, SessionJob, Status
from service.core.tinker.wire import TinkerPath
from service.store import jobs as jobs_q
from service.store import records
from service.store.db import session_scope
from service.store.models import Checkpoint, Job, JobEvent, SessionCheckpoint, SessionOp, TinkerSession, utcnow


def create_session(session: Session, *, owner: str, tags: list[str], user_metadata: dict,
                   sdk_version: str) -> TinkerSession:
    row = TinkerSession(owner=owner, tags=tags, user_metadata=user_metadata, sdk_version=sdk_version[:40])
    session.add(row)
    session.flush()
    return row


def get_session(session: Session, *, session_id: str, owner: str) -> TinkerSession | None:
    row = session.get(TinkerSession, session_id)
    return row if row is not None and row.owner == owner else None  # another owner's reads as missing


def list_sessions(session: Session, *, owner: str, limit: int, offset: int) -> list[TinkerSession]:
    return list(session.scalars(select(TinkerSession).where(TinkerSession.owner == owner)
                                .order_by(TinkerSession.created_at.desc(), TinkerSession.id)
                                .limit(limit).offset(offset)))


def session_runs(session: Session, *, session_id: str, owner: str) -> list[Job]:
    return list(session.scalars(select(Job).where(Job.owner == owner, Job.kind == "session",
                                                  Job.spec["session"]["tinker_session"].as_string() == session_id)
                                .order_by(Job.id)))


def create_run(session: Session, *, owner: str, spec: SessionJob) -> Job:
    """A session run, queued; its first operation is `create_model`, whose future completes once a worker
    has loaded the model."""
    job = Job(uid=spec.session.model_id, owner=owner, kind=spec.kind, spec=spec.model_dump(mode="json"),
              name=spec.name, total_steps=0, gpus=spec.gpus)
    session.add(job)
    session.flush()
    session.add(JobEvent(job_id=job.id, type="created", message=f"session run of {spec.model.name} created by "
                         f"tinker session {spec.session.tinker_session}"))
    return job


def run_for_model(session: Session, *, model_id: str, owner: str, for_update: bool = False) -> Job | None:
    """The session run a tinker `model_id` names, if this owner's: the job's uid, or
    `<session_id>:train:<model_seq_id>` (the id the SDK gives a run it created from a saved state)."""
    q = select(Job).where(Job.owner == owner, Job.kind == "session")
    tinker_session, _, seq = model_id.partition(":train:")
    if seq:
        if not seq.isdigit() or len(seq) > 9:
            return None
        spec = Job.spec["session"]
        q = q.where(spec["tinker_session"].as_string() == tinker_session, spec["model_seq_id"].as_integer() == int(seq))
    else:
        q = q.where(Job.uid == model_id)
    q = q.order_by(Job.id.desc())
    return session.scalars(q.with_for_update() if for_update else q).first()


def add_op(session: Session, *, job: Job, kind: str, body: bytes, seq: int | None = None) -> SessionOp:
    """An operation for `job`, run after those before it: in the client's `seq` order when it sends one,
    else after everything sent so far."""
    if seq is None:
        seq = (session.scalar(select(func.max(SessionOp.seq)).where(SessionOp.job_id == job.id)) or 0) + 1
    op = SessionOp(request_id="req-" + uuid.uuid4().hex, job_id=job.id, seq=seq, kind=kind, body=body)
    session.add(op)
    session.flush()
    return op


def add_refused(session: Session, *, job: Job, kind: str, seq: int | None, error: str) -> SessionOp:
    """An operation sent to a run that takes no more: stored already failed (category `user`, with why), with
    no body, so its future ends at once and a retry of the same call finds it."""
    op = add_op(session, job=job, kind=kind, body=b"", seq=seq)
    op.status, op.error, op.category, op.finished_at = "failed", error, "user", utcnow()
    session.flush()
    return op


def sent_before(session: Session, *, job_id: int, kind: str, body: bytes, seq: int) -> SessionOp | None:
    """The operation a client already sent with this `seq`, kind and body: the same call again (the SDK
    retries a request whose answer it did not get: a timeout, a reset connection). Its seq numbers are
    unique per training client, so a match is a retry, never a second call."""
    for op in session.scalars(select(SessionOp).where(SessionOp.job_id == job_id, SessionOp.seq == seq,
                                                      SessionOp.kind == kind)):
        if op.body == body:
            return op
    return None


def op_for(session: Session, *, request_id: str, owner: str) -> SessionOp | None:
    """An operation by its request id, if its run is this owner's."""
    return session.scalars(select(SessionOp).join(Job, Job.id == SessionOp.job_id)
                           .where(SessionOp.request_id == request_id, Job.owner == owner)).first()


def wake(session: Session, *, job_id: int) -> Message | None:
    """idle -> queued, for a worker to take the run back. Returns the message to enqueue (once this
    transaction commits), or None when the run was not idle (a worker holds it, or it is queued)."""
    row = session.execute(update(Job).where(Job.id == job_id, Job.status == Status.idle)
                          .values(status=Status.queued, updated_at=utcnow()).returning(Job.uid, Job.gpus)
                          .execution_options(synchronize_session=False)).first()
    return None if row is None else Message(job_id, row.uid, row.gpus)


def unwake(session: Session, *, job_id: int, why: str) -> bool:
    """queued -> idle, for a run whose message could not be sent (the broker is down): its operations stay
    pending, stored once, and the sweep wakes it again once the broker answers (`wake_stranded`). False
    when the run was no longer queued (a worker took it through another message)."""
    moved = session.execute(update(Job).where(Job.id == job_id, Job.status == Status.queued,
                                              Job.lease_owner.is_(None), Job.kind == "session")
                            .values(status=Status.idle, updated_at=utcnow())
                            .execution_options(synchronize_session=False)).rowcount == 1
    if moved:
        session.add(JobEvent(job_id=job_id, type="idle", level="warning",
                             message=f"not queued: {why}; its operations are kept and it is queued again once "
                             "the broker answers"))
    return moved


def wake_stranded(url: str, *, older_than_s: float) -> list[Message]:
    """Idle runs that have a pending operation older than `older_than_s` (the sweep's safety net)."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    pending = exists().where(SessionOp.job_id == Job.id, SessionOp.status == "pending", SessionOp.created_at < cutoff)
    with session_scope(url) as session:
        ids = session.scalars(select(Job.id).where(Job.status == Status.idle, pending)).all()
        return [m for job_id in ids if (m := wake(session, job_id=job_id)) is not None]


def _not_cancelled(job_id: int):
    """No operation of a run is started once its cancel was accepted (what was pending failed with it)."""
    return ~exists().where(Job.id == job_id, Job.cancel_requested.is_(True))


def next_op(url: str, *, job_id: int) -> PendingOp | None:
    with session_scope(url, read_only=True) as session:
        op = session.scalars(select(SessionOp).where(SessionOp.job_id == job_id, SessionOp.status == "pending",
                                                     _not_cancelled(job_id))
                             .order_by(SessionOp.seq, SessionOp.id).limit(1)).first()
        return None if op is None else PendingOp(id=op.id, request_id=op.request_id, kind=op.kind, body=op.body)


def next_run(url: str, *, job_id: int, kind: str, limit: int) -> list[PendingOp]:
    """The run's next pending operations while they are of `kind`, in order (at most `limit`): what can
    run together without reordering anything the client sent."""
    with session_scope(url, read_only=True) as session:
        head = session.execute(select(SessionOp.id, SessionOp.kind)
                               .where(SessionOp.job_id == job_id, SessionOp.status == "pending",
                                      _not_cancelled(job_id))
                               .order_by(SessionOp.seq, SessionOp.id).limit(limit)).all()
        ids = [row.id for row in takewhile(lambda row: row.kind == kind, head)]
        ops = session.scalars(select(SessionOp).where(SessionOp.id.in_(ids)).order_by(SessionOp.seq, SessionOp.id))
        return [PendingOp(id=op.id, request_id=op.request_id, kind=op.kind, body=op.body) for op in ops]


def complete_ops(url: str, *, results: list[OpResult]) -> None:
    """Operations' results, and the samples they drew: all recorded in one transaction, or none."""
    with session_scope(url) as session:
        for r in results:
            done = session.execute(update(SessionOp).where(SessionOp.id == r.op.id, SessionOp.status == "pending")
                                   .values(status="done", result=r.result, result_format=r.result_format,
                                           finished_at=utcnow()).returning(SessionOp.job_id)).first()
            if done is not None and r.samples is not None:
                records.append_samples(session, job_id=done.job_id, step=r.samples.step, rows=r.samples.rows)


def fail_op(url: str, *, op_id: int, error: str, category: str) -> None:
    with session_scope(url) as session:
        session.execute(update(SessionOp).where(SessionOp.id == op_id, SessionOp.status == "pending")
                        .values(status="failed", error=error, category=category, finished_at=utcnow()))


def fail_pending(url: str, *, job_id: int, error: str, category: str) -> int:
    """Every pending operation of a run that ended: its futures fail instead of waiting forever."""
    with session_scope(url) as session:
        return jobs_q.fail_pending_in(session, job_ids=[job_id], error=error, category=category)


def fail_orphaned(url: str) -> int:
    """Pending operations of runs that have ended (one stored in the instant its run ended): failed, naming
    the run's status. The sweep's safety net; the transitions themselves fail what is pending then."""
    with session_scope(url) as session:
        rows = session.execute(select(Job.id, Job.status).join(SessionOp, SessionOp.job_id == Job.id)
                               .where(SessionOp.status == "pending", Job.status.in_(TERMINAL)).distinct()).all()
        return sum(jobs_q.fail_pending_in(session, job_ids=[job_id], error=f"the run has ended ({status})",
                                   category="user" if status == Status.cancelled else "server")
                   for job_id, status in rows)


def give_back(url: str, *, job_id: int, holder: str, message: str) -> Literal["idle"] | Message | None:
    """A run's worker is done with it for now (`message`: why, and the state it saved): `idle` while
    nothing is pending, else `queued` (enqueue the returned message). The lease goes, and so does the attempt
    it took: giving a run back is not a failed attempt. None when the lease was no longer `holder`'s."""
    pending = exists().where(SessionOp.job_id == job_id, SessionOp.status == "pending")
    with session_scope(url) as session:
        row = session.execute(
            update(Job).where(Job.id == job_id, Job.lease_owner == holder, Job.status == Status.running)
            .values(status=case((pending, Status.queued), else_=Status.idle), lease_owner=None, heartbeat_at=None,
                    attempt=Job.attempt - 1, updated_at=utcnow())
            .returning(Job.status, Job.uid, Job.gpus).execution_options(synchronize_session=False)).first()
        if row is None:
            return None
        session.add(JobEvent(job_id=job_id, type=row.status, message=message + (
            "; the next operation brings the run back" if row.status == Status.idle else
            "; operations are pending: queued again at once")))
    return "idle" if row.status == Status.idle else Message(job_id, row.uid, row.gpus)


def _named(session: Session, *, job_id: int, kind: str, name: str) -> SessionCheckpoint | None:
    """The row of `tinker://<run>/<kind>/<name>`, if the name exists."""
    return session.scalars(select(SessionCheckpoint).where(SessionCheckpoint.job_id == job_id,
                                                           SessionCheckpoint.kind == kind,
                                                           SessionCheckpoint.name == name)).first()


def name_checkpoint(url: str, *, job_id: int, kind: str, name: str, step: int) -> None:
    """`tinker://<run>/<kind>/<name>` is now step `step`'s checkpoint (a name saved again moves)."""
    with session_scope(url) as session:
        row = _named(session, job_id=job_id, kind=kind, name=name)
        if row is None:
            session.add(SessionCheckpoint(job_id=job_id, kind=kind, name=name, step=step))
        else:
            row.step, row.created_at = step, utcnow()


def find_named(session: Session, *, path: TinkerPath, owner: str) -> tuple[Job, int] | None:
    """The run and step a tinker path names, if this owner's."""
    job = run_for_model(session, model_id=path.model_id, owner=owner)
    row = None if job is None else _named(session, job_id=job.id, kind=path.kind, name=path.name)
    return None if row is None else (job, row.step)


def drop_name(session: Session, *, job_id: int, kind: str, name: str) -> bool:
    """`tinker://<run>/<kind>/<name>` names nothing any more; the step's checkpoint stays the run's."""
    row = _named(session, job_id=job_id, kind=kind, name=name)
    if row is not None:
        session.delete(row)
    return row is not None


def owned_runs(session: Session, *, owner: str, limit: int, offset: int) -> tuple[list[Job], int]:
    """A page of this owner's session runs, newest first, and how many there are."""
    mine = (Job.owner == owner) & (Job.kind == "session")
    total = session.scalar(select(func.count()).select_from(Job).where(mine))
    return list(session.scalars(select(Job).where(mine).order_by(Job.id.desc()).limit(limit).offset(offset))), total


NamedCheckpoint = tuple[Job, SessionCheckpoint, Checkpoint | None]  # a name, its run, and its step's row


def _owned_names(owner: str, job_ids: list[int] | None) -> list:
    """The conditions on a name of this owner's runs (of `job_ids` only, when given)."""
    return [Job.owner == owner, Job.kind == "session"] + ([Job.id.in_(job_ids)] if job_ids is not None else [])


def owned_named(session: Session, *, owner: str, job_ids: list[int] | None = None, limit: int | None = None,
                offset: int = 0) -> list[NamedCheckpoint]:
    """This owner's named checkpoints (of `job_ids` only, when given), newest first."""
    q = (select(Job, SessionCheckpoint, Checkpoint).join(Job, Job.id == SessionCheckpoint.job_id)
         .outerjoin(Checkpoint, (Checkpoint.job_id == SessionCheckpoint.job_id)
                    & (Checkpoint.step == SessionCheckpoint.step))
         .where(*_owned_names(owner, job_ids))
         .order_by(SessionCheckpoint.created_at.desc(), SessionCheckpoint.id.desc())
         .limit(limit).offset(offset))
    return [(job, named, step) for job, named, step in session.execute(q).all()]


def count_named(session: Session, *, owner: str) -> int:
    """How many named checkpoints this owner's runs have."""
    return session.scalar(select(func.count()).select_from(SessionCheckpoint)
                          .join(Job, Job.id == SessionCheckpoint.job_id).where(*_owned_names(owner, None)))
