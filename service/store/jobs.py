"""Job rows: creation, listing, cancellation and the worker lease."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.specs import TERMINAL
from service.store.models import Job, JobEvent, utcnow


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


def request_cancel(session: Session, *, job: Job) -> Job:
    """Queued jobs are cancelled at once; running ones stop cooperatively at the next step."""
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


def acquire_lease(session: Session, *, job_id: int, holder: str, lease_timeout_s: float) -> bool:
    """Atomically take a queued job, or a running one whose holder stopped heartbeating.

    A single conditional UPDATE, so two deliveries of the same message can never both win.
    """
    now = datetime.now(timezone.utc)
    stale = now - timedelta(seconds=lease_timeout_s)
    result = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            or_(Job.status == "queued",
                (Job.status == "running") & or_(Job.heartbeat_at.is_(None), Job.heartbeat_at < stale)),
        )
        .values(status="running", lease_owner=holder, heartbeat_at=now, attempt=Job.attempt + 1,
                started_at=func.coalesce(Job.started_at, now), updated_at=now)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return result.rowcount == 1


def heartbeat(session: Session, *, job_id: int, holder: str, step: int | None = None) -> bool | None:
    """Renew the lease. Returns cancel_requested, or None when the lease was lost."""
    values: dict = {"heartbeat_at": utcnow()}
    if step is not None:
        values["step"] = step
    result = session.execute(
        update(Job).where(Job.id == job_id, Job.lease_owner == holder, Job.status == "running")
        .values(**values).execution_options(synchronize_session=False)
    )
    session.commit()
    if result.rowcount != 1:
        return None
    return bool(session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def finish_job(session: Session, *, job_id: int, holder: str | None, status: str, error: str | None = None) -> bool:
    assert status in TERMINAL
    q = update(Job).where(Job.id == job_id, Job.status.not_in(TERMINAL))
    if holder is not None:
        q = q.where(Job.lease_owner == holder)
    result = session.execute(
        q.values(status=status, error=error, finished_at=utcnow(), lease_owner=None)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return result.rowcount == 1


def release_lease(session: Session, *, job_id: int, holder: str) -> None:
    """Give a running job back to the queue state (e.g. worker shutting down mid-job)."""
    session.execute(
        update(Job).where(Job.id == job_id, Job.lease_owner == holder, Job.status == "running")
        .values(heartbeat_at=None).execution_options(synchronize_session=False)
    )
    session.commit()


def orphaned_job_ids(session: Session, *, lease_timeout_s: float, queued_for_s: float = 60.0) -> list[int]:
    """Jobs that may have lost their broker message: running with a stale heartbeat, or queued
    for a while. Re-enqueueing them is safe: the lease lets only one delivery run a job."""
    now = datetime.now(timezone.utc)
    q = select(Job.id).where(or_(
        (Job.status == "running") & or_(Job.heartbeat_at.is_(None),
                                        Job.heartbeat_at < now - timedelta(seconds=lease_timeout_s)),
        (Job.status == "queued") & (Job.created_at < now - timedelta(seconds=queued_for_s)),
    ))
    return list(session.scalars(q.order_by(Job.id)))
