"""Typed job events: created, started, checkpoint, warning, failed, ..."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.health import EVENT, HealthFlag, flag_from_event
from service.store.models import JobEvent


def add_event(
    session: Session, *, job_id: int, type: str, message: str = "", level: str = "info", data: dict | None = None,
) -> JobEvent:
    ev = JobEvent(job_id=job_id, type=type, level=level, message=message, data=data)
    session.add(ev)
    session.flush()
    return ev


def list_events(session: Session, *, job_id: int, after_id: int = 0, limit: int = 500) -> list[JobEvent]:
    q = (select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after_id)
         .order_by(JobEvent.id).limit(limit))
    return list(session.scalars(q))


def health_flags(session: Session, *, job_id: int) -> list[HealthFlag]:
    """A job's health flags, oldest first (the `health` events' data)."""
    q = select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == EVENT).order_by(JobEvent.id)
    return [f for f in map(flag_from_event, session.scalars(q)) if f is not None]


def latest_data(session: Session, *, job_id: int, type: str) -> dict | None:
    """The data of a job's newest event of `type` (None: no such event yet)."""
    q = (select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == type)
         .order_by(JobEvent.id.desc()).limit(1))
    return session.scalars(q).first()
