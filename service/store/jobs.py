"""Job rows: creation, listing, cancellation and the worker lease."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.core.specs import TERMINAL, Status
from service.store.models import (
    Checkpoint,
    Job,
    JobEvent,
    Metric,
    Sample,
    Selection,
    SessionCheckpoint,
    SessionOp,
    SparsityReport,
    utcnow,
)


def create_job(
    session: Session, *, owner: str, kind: str, spec: dict, name: str | None, total_steps: int, gpus: int = 0,
    idempotency_key: str | None = None,
) -> tuple[Job, bool]:
    """Insert a queued job. With an idempotency key already used by this owner, return that job."""
    if idempotency_key is not None:
        existing = session.scalar(
            select(Job).where(Job.owner == owner, Job.idempotency_key == idempotency_key)
        )
        if existing is not None:
            return existing, False
    job = Job(owner=owner, kind=kind, spec=spec, name=name, total_steps=total_steps, gpus=gpus,
              idempotency_key=idempotency_key, status=Status.queued)
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
    now = datetime.now(UTC)
    if job.status == Status.running and session.execute(
        update(Job).where(Job.id == job.id, Job.lease_stale(now, lease_timeout_s))
        .values(status=Status.cancelled, finished_at=now, lease_owner=None, cancel_requested=True)
        .execution_options(synchronize_session=False)
    ).rowcount == 1:
        session.add(JobEvent(job_id=job.id, type="cancelled",
                             message="cancelled; its worker had stopped (lease expired)"))
        fail_pending_in(session, job_ids=[job.id], error="the run was cancelled", category="user")
        session.flush()
        session.refresh(job)
        return job
    if job.status in (Status.queued, Status.idle):
        message = "cancelled before it started" if job.status == Status.queued else "cancelled while no worker held it"
        job.status = Status.cancelled
        job.finished_at = utcnow()
        session.add(JobEvent(job_id=job.id, type="cancelled", message=message))
        fail_pending_in(session, job_ids=[job.id], error=f"the run was {message}", category="user")
    elif job.status == Status.running and not job.cancel_requested:
        job.cancel_requested = True
        session.add(JobEvent(job_id=job.id, type="cancel_requested",
                             message="cancel requested; the job stops after its current step" if job.kind != "session"
                             else "cancel requested; its pending operations fail and it takes no new one"))
        # a session run's queued operations fail with the cancel, not when its worker next hears of it
        fail_pending_in(session, job_ids=[job.id], error="the run was cancelled", category="user")
    session.flush()
    return job


def fail_pending_in(session: Session, *, job_ids: list[int], error: str, category: str) -> int:
    """The pending tinker operations of runs that have ended, failed with `error` in the caller's
    transaction: a run's terminal status and its failed futures commit together (every transition to a
    terminal status calls it), so no future waits for a run that will never run it."""
    return session.execute(update(SessionOp).where(SessionOp.job_id.in_(job_ids), SessionOp.status == "pending")
                           .values(status="failed", error=error, category=category, finished_at=utcnow())
                           .execution_options(synchronize_session=False)).rowcount


def active_jobs(session: Session, *, owner: str) -> list[Job]:
    """The owner's queued and running jobs: what still needs the files and checkpoints it names."""
    return list(session.scalars(select(Job).where(Job.owner == owner, Job.status.not_in(TERMINAL))))


def delete_job(session: Session, *, job: Job) -> None:
    """Delete a job and every row it owns."""
    for table in (JobEvent, Metric, Sample, Selection, SparsityReport, Checkpoint, SessionOp, SessionCheckpoint):
        session.execute(delete(table).where(table.job_id == job.id))
    session.delete(job)


def job_versions(session: Session, *, job_ids: list[int]) -> dict[int, tuple]:
    """One statement: a value per job that changes whenever its stream has something to send."""
    newest_event = select(func.max(JobEvent.id)).where(JobEvent.job_id == Job.id).scalar_subquery()
    newest_step = select(func.max(Metric.step)).where(Metric.job_id == Job.id).scalar_subquery()
    rows = session.execute(select(Job.id, Job.status, Job.step, Job.cancel_requested, newest_event, newest_step)
                           .where(Job.id.in_(job_ids))).all()
    return {row[0]: tuple(row[1:]) for row in rows}


def job_changes(session: Session, *, job_id: int) -> tuple[int | None, int | None, int | None, int]:
    """What the job's records have come to, from its indexes: its newest event's id, its newest sample's id
    (a tinker run's samples come without a step), its newest metric step and how many metric points it has
    (a resume rewrites points only after a `resumed` event)."""
    newest_event = select(func.max(JobEvent.id)).where(JobEvent.job_id == job_id).scalar_subquery()
    newest_sample = select(func.max(Sample.id)).where(Sample.job_id == job_id).scalar_subquery()
    return tuple(session.execute(select(newest_event, newest_sample, func.max(Metric.step), func.count())
                                 .select_from(Metric).where(Metric.job_id == job_id)).one())
