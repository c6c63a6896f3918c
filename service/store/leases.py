"""The lease state machine: queued -> running (leased) -> succeeded | failed | cancelled, or back
to queued. Every transition is one conditional UPDATE in a transaction of its own: these functions
take the store's URL and open (and commit) their own scope, never a caller's session, so a lease
changes hands exactly when the statement that moves it commits."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError
from sqlalchemy import func, or_, select, update

from service.core.queue import Message
from service.core.specs import TERMINAL, JobSpec, Status, SubmittedSpec, parse_stored_spec
from service.store import nodes, session_ops
from service.store.db import session_scope
from service.store.jobs import create_job, fail_pending_in
from service.store.models import Job, JobEvent, utcnow


@dataclass(frozen=True)
class Submitted:
    job: Job  # detached, its columns loaded
    created: bool  # False: the owner's idempotency key named this job already


def submit_job(url: str, *, owner: str, spec: SubmittedSpec, idempotency_key: str | None = None) -> Submitted:
    """The first state, queued, committed before the job is enqueued: a worker must find the row
    its message names, and a broker that is down must be able to fail a job that exists."""
    with session_scope(url) as session:
        job, created = create_job(session, owner=owner, kind=spec.kind, spec=spec.model_dump(mode="json"),
                                  name=spec.name, total_steps=spec.train.steps, gpus=spec.gpus,
                                  idempotency_key=idempotency_key)
    return Submitted(job=job, created=created)


@dataclass(frozen=True)
class Lease:
    """What a worker needs of a job it has just leased, read by the statement that leased it."""

    job_id: int
    uid: str
    owner: str
    kind: str
    spec: JobSpec | None  # None: stored by a version whose spec this one no longer accepts
    spec_error: str | None  # why, then
    attempt: int
    cancel_requested: bool


def acquire_lease(url: str, *, job_id: int, holder: str, lease_timeout_s: float,
                  uid: str | None = None) -> Lease | None:
    """Atomically take a queued job, or a running one whose holder stopped heartbeating.

    One conditional UPDATE ... RETURNING: two deliveries of a message can never both win, and
    the row is read in the same statement. `uid` (from the message) must match, so a message
    meant for another store's job with the same id never runs here.
    """
    now = datetime.now(UTC)
    q = update(Job).where(Job.id == job_id, or_(Job.status == Status.queued, Job.lease_stale(now, lease_timeout_s)))
    if uid is not None:
        q = q.where(Job.uid == uid)
    with session_scope(url) as session:
        row = session.execute(
            q.values(status=Status.running, lease_owner=holder, heartbeat_at=now, attempt=Job.attempt + 1,
                     started_at=func.coalesce(Job.started_at, now), updated_at=now)
            .returning(Job.id.label("job_id"), Job.uid, Job.owner, Job.kind, Job.spec, Job.attempt,
                       Job.cancel_requested)
            .execution_options(synchronize_session=False)
        ).first()
    if row is None:
        return None
    fields = dict(row._mapping)
    try:
        fields.update(spec=parse_stored_spec(fields["spec"]), spec_error=None)
    except ValidationError as exc:
        fields.update(spec=None, spec_error=f"stored spec is no longer valid: {exc.error_count()} errors, first: "
                      f"{exc.errors()[0]['msg']}")
    return Lease(**fields)


def heartbeat(url: str, *, job_id: int, holder: str, step: int | None = None) -> bool | None:
    """Renew the lease. Returns cancel_requested, or None when the lease was lost."""
    values: dict = {"heartbeat_at": utcnow()}
    if step is not None:
        values["step"] = step
    with session_scope(url) as session:
        row = session.execute(
            update(Job).where(Job.id == job_id, Job.lease_owner == holder, Job.status == Status.running)
            .values(**values).returning(Job.cancel_requested).execution_options(synchronize_session=False)
        ).first()
    return None if row is None else bool(row.cancel_requested)


def finish_job(url: str, *, job_id: int, holder: str | None, status: str, message: str,
               error: str | None = None, data: dict | None = None, level: str | None = None) -> bool:
    """Record a job's outcome: its terminal status and its final event, in one transaction.

    With a `holder`, only while that worker still holds the lease. False if nothing changed."""
    if status not in TERMINAL:
        raise ValueError(f"{status!r} is not a terminal status")
    q = update(Job).where(Job.id == job_id, Job.status.not_in(TERMINAL))
    if holder is not None:
        q = q.where(Job.lease_owner == holder)
    with session_scope(url) as session:
        result = session.execute(
            q.values(status=status, error=error, finished_at=utcnow(), lease_owner=None)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:
            return False
        session.add(JobEvent(job_id=job_id, type=status, message=message, data=data,
                             level=level or ("error" if status == Status.failed else "info")))
        fail_pending_in(session, job_ids=[job_id], error=f"the run ended ({status}): {message}",
                                    category="user" if status == Status.cancelled else "server")
    return True


def requeue(url: str, *, job_id: int, holder: str, message: str, failed: bool = True,
            data: dict | None = None) -> Message | None:
    """An attempt that ended without an outcome of its own (a process of it was killed): back to
    `queued` with a warning event, while `holder` holds the lease. Returns the message to enqueue
    again, or None if the lease was no longer ours. `failed` False: the attempt never started (a multi-node
    job whose other nodes did not come), so it does not count towards GRPO_MAX_ATTEMPTS."""
    with session_scope(url) as session:
        row = session.execute(
            update(Job).where(Job.id == job_id, Job.lease_owner == holder, Job.status == Status.running)
            .values(status=Status.queued, lease_owner=None, heartbeat_at=None, updated_at=utcnow(),
                    attempt=Job.attempt - (0 if failed else 1))
            .returning(Job.uid, Job.gpus, Job.attempt).execution_options(synchronize_session=False)
        ).first()
        if row is None:
            return None
        if not failed:
            nodes.forget_attempt(session, job_id=job_id, attempt=row.attempt + 1)
        session.add(JobEvent(job_id=job_id, type="requeued" if failed else "waiting", level="warning",
                             message=message, data=data))
    return Message(job_id, row.uid, row.gpus)


@dataclass(frozen=True)
class Swept:
    """What one sweep did: jobs to enqueue again, and stranded jobs it cancelled."""

    requeue: list[Message]
    cancelled: list[int]


def sweep(url: str, *, lease_timeout_s: float, requeue_queued_after_s: float) -> Swept:
    """Take back jobs nobody is running, safely from any number of workers at once.

    - running with an expired lease: back to `queued` (to be enqueued again), or `cancelled`
      when a cancel was asked for;
    - queued and not enqueued for `requeue_queued_after_s` (its message may be lost: a broker
      restarted empty): enqueued again.
    Each job is claimed by a conditional UPDATE in a transaction of its own, so of several
    sweepers exactly one acts on it. A job enqueued twice still runs once: the lease decides.
    """
    now = datetime.now(UTC)
    with session_scope(url) as session:
        expired = session.execute(select(Job.id, Job.cancel_requested).where(Job.lease_stale(now, lease_timeout_s))).all()
    requeue, cancelled = [], []
    for job_id, cancel in expired:
        claim = update(Job).where(Job.id == job_id, Job.lease_stale(now, lease_timeout_s))
        with session_scope(url) as session:
            if cancel:
                if session.execute(claim.values(status=Status.cancelled, finished_at=now, lease_owner=None,
                                                updated_at=now).execution_options(synchronize_session=False)
                                   ).rowcount == 1:
                    session.add(JobEvent(job_id=job_id, type="cancelled",
                                         message="cancelled: its worker had stopped (lease expired)"))
                    fail_pending_in(session, job_ids=[job_id], error="the run was cancelled",
                                                category="user")
                    cancelled.append(job_id)
                continue
            row = session.execute(claim.values(status=Status.queued, lease_owner=None, heartbeat_at=None, updated_at=now)
                                  .returning(Job.uid, Job.gpus).execution_options(synchronize_session=False)).first()
            if row is not None:
                session.add(JobEvent(job_id=job_id, type="requeued", level="warning",
                                     message=f"its worker stopped renewing the lease for {lease_timeout_s:g} s; "
                                     "queued again, it resumes from its last checkpoint"))
                requeue.append(Message(job_id, row.uid, row.gpus))
    idle = now - timedelta(seconds=requeue_queued_after_s)
    with session_scope(url) as session:
        waiting = session.execute(select(Job.id, Job.updated_at)
                                  .where(Job.status == Status.queued, Job.updated_at < idle)).all()
    for job_id, seen in waiting:
        with session_scope(url) as session:
            row = session.execute(update(Job).where(Job.id == job_id, Job.status == Status.queued, Job.updated_at == seen)
                                  .values(updated_at=now).returning(Job.uid, Job.gpus)
                                  .execution_options(synchronize_session=False)).first()
        if row is not None:
            requeue.append(Message(job_id, row.uid, row.gpus))
    # an operation that reached an idle session run as its worker gave the run back
    requeue += session_ops.wake_stranded(url, older_than_s=5.0)
    session_ops.fail_orphaned(url)
    return Swept(requeue=requeue, cancelled=cancelled)
