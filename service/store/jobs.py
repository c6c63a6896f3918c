"""Job rows: creation, listing, cancellation and the worker lease."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.core.specs import TERMINAL
from service.store.models import (
    Checkpoint,
    Job,
    JobEvent,
    Metric,
    Sample,
    Selection,
    SparsityReport,
    utcnow,
)


def create_job(
    session: Session, *, owner: str, kind: str, spec: dict, name: str | None, total_steps: int,
    idempotency_key: str | None = None,
) -> tuple[Job, bool]:
    """Insert a queued job. With an idempotency key already used by this owner, return that job."""
    if idempotency_key is not None:
        existing = session.scalar(
            select(Job).where(Job.owner == owner, Job.idempotency_key == idempotency_key)
        )
        if existing is not None:
            return existing, False
    job = Job(owner=owner, kind=kind, spec=spec, name=name, total_steps=total_steps,
              idempotency_key=idempotency_key, status="queued")
    session.add(job)
    try:
        session.flush()
    except IntegrityError:  # a concurrent retry with the same key won the race
        session.rollback()
        return session.scalars(
            select(Job).where(Job.owner == owner, Job.idempotency_key == idempotency_key)
        ).one(), False
    session.add(JobEvent(job_id=job.id, type="created", message=f"{kind} job queued"))
    return job, True


def get_job(session: Session, *, job_id: int, owner: str | None = None) -> Job | None:
    job = session.get(Job, job_id)
    if job is None or (owner is not None and job.owner != owner):
        return None
    return job


def list_jobs(
    session: Session, *, owner: str, status: str | None = None, kind: str | None = None,
    after: int | None = None, limit: int = 50,
) -> tuple[list[Job], bool]:
    """Newest first. `after` is the id of the last job of the previous page."""
    q = select(Job).where(Job.owner == owner)
    if status:
        q = q.where(Job.status == status)
    if kind:
        q = q.where(Job.kind == kind)
    if after is not None:
        q = q.where(Job.id < after)
    rows = list(session.scalars(q.order_by(Job.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def count_by_status(session: Session) -> dict[str, int]:
    return dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())


def request_cancel(session: Session, *, job: Job, lease_timeout_s: float) -> Job:
    """Queued jobs, and running ones whose worker stopped renewing its lease, are cancelled at
    once; running ones stop cooperatively at the next step."""
    now = datetime.now(timezone.utc)
    if job.status == "running" and session.execute(
        update(Job).where(Job.id == job.id, _stale(now, lease_timeout_s))
        .values(status="cancelled", finished_at=now, lease_owner=None, cancel_requested=True)
        .execution_options(synchronize_session=False)
    ).rowcount == 1:
        session.add(JobEvent(job_id=job.id, type="cancelled",
                             message="cancelled; its worker had stopped (lease expired)"))
        session.flush()
        session.refresh(job)
        return job
    if job.status == "queued":
        job.status = "cancelled"
        job.finished_at = utcnow()
        session.add(JobEvent(job_id=job.id, type="cancelled", message="cancelled before it started"))
    elif job.status == "running" and not job.cancel_requested:
        job.cancel_requested = True
        session.add(JobEvent(job_id=job.id, type="cancel_requested",
                             message="cancel requested; the job stops after its current step"))
    session.flush()
    return job


@dataclass(frozen=True)
class Lease:
    """What a worker needs of a job it has just leased, read by the statement that leased it."""

    job_id: int
    uid: str
    owner: str
    kind: str
    spec: dict
    attempt: int
    cancel_requested: bool


def acquire_lease(session: Session, *, job_id: int, holder: str, lease_timeout_s: float,
                  uid: str | None = None) -> Lease | None:
    """Atomically take a queued job, or a running one whose holder stopped heartbeating.

    One conditional UPDATE ... RETURNING: two deliveries of a message can never both win, and
    the row is read in the same statement. `uid` (from the message) must match, so a message
    meant for another store's job with the same id never runs here.
    """
    now = datetime.now(timezone.utc)
    q = update(Job).where(Job.id == job_id, or_(Job.status == "queued", _stale(now, lease_timeout_s)))
    if uid is not None:
        q = q.where(Job.uid == uid)
    row = session.execute(
        q.values(status="running", lease_owner=holder, heartbeat_at=now, attempt=Job.attempt + 1,
                 started_at=func.coalesce(Job.started_at, now), updated_at=now)
        .returning(Job.id, Job.uid, Job.owner, Job.kind, Job.spec, Job.attempt, Job.cancel_requested)
        .execution_options(synchronize_session=False)
    ).first()
    session.commit()
    return None if row is None else Lease(*row)


def _stale(now: datetime, lease_timeout_s: float):
    """A running job whose holder has not renewed its lease within the timeout."""
    return (Job.status == "running") & or_(
        Job.heartbeat_at.is_(None), Job.heartbeat_at < now - timedelta(seconds=lease_timeout_s))


def heartbeat(session: Session, *, job_id: int, holder: str, step: int | None = None) -> bool | None:
    """Renew the lease. Returns cancel_requested, or None when the lease was lost."""
    values: dict = {"heartbeat_at": utcnow()}
    if step is not None:
        values["step"] = step
    row = session.execute(
        update(Job).where(Job.id == job_id, Job.lease_owner == holder, Job.status == "running")
        .values(**values).returning(Job.cancel_requested).execution_options(synchronize_session=False)
    ).first()
    session.commit()
    return None if row is None else bool(row[0])


def finish_job(session: Session, *, job_id: int, holder: str | None, status: str, message: str,
               error: str | None = None, data: dict | None = None, level: str | None = None) -> bool:
    """Record a job's outcome: its terminal status and its final event, in one transaction.

    With a `holder`, only while that worker still holds the lease. False if nothing changed."""
    if status not in TERMINAL:
        raise ValueError(f"{status!r} is not a terminal status")
    q = update(Job).where(Job.id == job_id, Job.status.not_in(TERMINAL))
    if holder is not None:
        q = q.where(Job.lease_owner == holder)
    result = session.execute(
        q.values(status=status, error=error, finished_at=utcnow(), lease_owner=None)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        session.rollback()
        return False
    session.add(JobEvent(job_id=job_id, type=status, message=message, data=data,
                         level=level or ("error" if status == "failed" else "info")))
    session.commit()
    return True


def requeue(session: Session, *, job_id: int, holder: str, message: str) -> str | None:
    """An attempt that ended without an outcome of its own (a process of it was killed): back to
    `queued` with a warning event, while `holder` holds the lease. Returns the job's uid to
    enqueue again, or None if the lease was no longer ours."""
    row = session.execute(
        update(Job).where(Job.id == job_id, Job.lease_owner == holder, Job.status == "running")
        .values(status="queued", lease_owner=None, heartbeat_at=None, updated_at=utcnow())
        .returning(Job.uid).execution_options(synchronize_session=False)
    ).first()
    if row is None:
        session.rollback()
        return None
    session.add(JobEvent(job_id=job_id, type="requeued", level="warning", message=message))
    session.commit()
    return row[0]


@dataclass(frozen=True)
class Swept:
    """What one sweep did: jobs to enqueue again, and stranded jobs it cancelled."""

    requeue: list[tuple[int, str]]
    cancelled: list[int]


def sweep(session: Session, *, lease_timeout_s: float, requeue_queued_after_s: float) -> Swept:
    """Take back jobs nobody is running, safely from any number of workers at once.

    - running with an expired lease: back to `queued` (to be enqueued again), or `cancelled`
      when a cancel was asked for;
    - queued and not enqueued for `requeue_queued_after_s` (its message may be lost: a broker
      restarted empty): enqueued again.
    Each job is claimed by a conditional UPDATE, so of several sweepers exactly one acts on it.
    A job enqueued twice still runs once: the lease decides.
    """
    now = datetime.now(timezone.utc)
    stale = session.execute(select(Job.id, Job.cancel_requested).where(_stale(now, lease_timeout_s))).all()
    requeue, cancelled = [], []
    for job_id, cancel in stale:
        claim = update(Job).where(Job.id == job_id, _stale(now, lease_timeout_s))
        if cancel:
            if session.execute(claim.values(status="cancelled", finished_at=now, lease_owner=None, updated_at=now)
                               .execution_options(synchronize_session=False)).rowcount == 1:
                session.add(JobEvent(job_id=job_id, type="cancelled",
                                     message="cancelled: its worker had stopped (lease expired)"))
                cancelled.append(job_id)
        else:
            row = session.execute(claim.values(status="queued", lease_owner=None, heartbeat_at=None, updated_at=now)
                                  .returning(Job.uid).execution_options(synchronize_session=False)).first()
            if row is not None:
                session.add(JobEvent(job_id=job_id, type="requeued", level="warning",
                                     message=f"its worker stopped renewing the lease for {lease_timeout_s:g} s; "
                                     "queued again, it resumes from its last checkpoint"))
                requeue.append((job_id, row[0]))
        session.commit()
    idle = now - timedelta(seconds=requeue_queued_after_s)
    waiting = session.execute(select(Job.id, Job.updated_at).where(Job.status == "queued", Job.updated_at < idle)).all()
    for job_id, seen in waiting:
        row = session.execute(update(Job).where(Job.id == job_id, Job.status == "queued", Job.updated_at == seen)
                              .values(updated_at=now).returning(Job.uid)
                              .execution_options(synchronize_session=False)).first()
        session.commit()
        if row is not None:
            requeue.append((job_id, row[0]))
    return Swept(requeue=requeue, cancelled=cancelled)


def active_jobs(session: Session, *, owner: str) -> list[Job]:
    """The owner's queued and running jobs: what still needs the files and checkpoints it names."""
    return list(session.scalars(select(Job).where(Job.owner == owner, Job.status.not_in(TERMINAL))))


def delete_job(session: Session, *, job: Job) -> None:
    """Delete a job and every row it owns."""
    for table in (JobEvent, Metric, Sample, Selection, SparsityReport, Checkpoint):
        session.execute(delete(table).where(table.job_id == job.id))
    session.delete(job)
