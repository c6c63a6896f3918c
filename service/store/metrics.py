"""Metric series: upserted points and server-side downsampling.

Downsampling buckets the step range into at most `max_points` equal-width buckets and returns,
per bucket, the mean with the bucket's min and max, so a one-step spike in a 100,000-step run
still shows in a 1,000-point chart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.store.models import Metric, utcnow


def _insert_for(session: Session):
    return pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert


def upsert_points(session: Session, *, rows: Iterable[tuple[int, str, int, float]]) -> int:
    """Write (job_id, key, step, value) rows; an existing (job_id, key, step) is overwritten."""
    now = utcnow()
    payload = [
        {"job_id": j, "key": k, "step": s, "value": float(v), "created_at": now}
        for j, k, s, v in rows
        if v is not None and math.isfinite(float(v))  # NaN/inf are reported as events, never stored
    ]
    if not payload:
        return 0
    insert = _insert_for(session)
    stmt = insert(Metric)
    stmt = stmt.on_conflict_do_update(
        index_elements=["job_id", "key", "step"],
        set_={"value": stmt.excluded.value, "created_at": stmt.excluded.created_at},
    )
    session.execute(stmt, payload)
    return len(payload)


def upsert_step(session: Session, *, job_id: int, step: int, values: Mapping[str, float]) -> int:
    return upsert_points(session, rows=((job_id, k, step, v) for k, v in values.items()))


def list_keys(session: Session, *, job_id: int) -> list[str]:
    return list(session.scalars(select(Metric.key).where(Metric.job_id == job_id).distinct().order_by(Metric.key)))


def series(
    session: Session, *, job_id: int, key: str, from_step: int | None = None, to_step: int | None = None,
    max_points: int = 1000,
) -> dict:
    """One series between from_step and to_step (inclusive), at most max_points points."""
    base = [Metric.job_id == job_id, Metric.key == key]
    if from_step is not None:
        base.append(Metric.step >= from_step)
    if to_step is not None:
        base.append(Metric.step <= to_step)
    lo, hi, n = session.execute(select(func.min(Metric.step), func.max(Metric.step), func.count()).where(*base)).one()
    if not n:
        return {"key": key, "points": [], "downsampled": False, "total_points": 0}
    if n <= max_points:
        rows = session.execute(select(Metric.step, Metric.value).where(*base).order_by(Metric.step)).all()
        points = [{"step": s, "value": v, "min": v, "max": v} for s, v in rows]
        return {"key": key, "points": points, "downsampled": False, "total_points": n}
    width = max(1, math.ceil((hi - lo + 1) / max_points))
    bucket = ((Metric.step - lo) // width).label("bucket")  # integer division on every backend
    rows = session.execute(
        select(bucket, func.min(Metric.step), func.avg(Metric.value), func.min(Metric.value), func.max(Metric.value))
        .where(*base).group_by(bucket).order_by(bucket)
    ).all()
    points = [{"step": s, "value": float(avg), "min": mn, "max": mx} for _, s, avg, mn, mx in rows]
    return {"key": key, "points": points, "downsampled": True, "total_points": n, "bucket_steps": width}


def latest(session: Session, *, job_id: int) -> dict[str, dict]:
    """The newest point of every series of a job."""
    newest = (select(Metric.key, func.max(Metric.step).label("step"))
              .where(Metric.job_id == job_id).group_by(Metric.key).subquery())
    rows = session.execute(
        select(Metric.key, Metric.step, Metric.value)
        .join(newest, (Metric.key == newest.c.key) & (Metric.step == newest.c.step))
        .where(Metric.job_id == job_id)
    ).all()
    return {k: {"step": s, "value": v} for k, s, v in rows}


def points_between(session: Session, *, job_id: int, after_step: int, to_step: int) -> dict[int, dict[str, float]]:
    """All points with after_step < step <= to_step, grouped by step (for live streams)."""
    rows = session.execute(
        select(Metric.step, Metric.key, Metric.value)
        .where(Metric.job_id == job_id, Metric.step > after_step, Metric.step <= to_step)
        .order_by(Metric.step)
    ).all()
    out: dict[int, dict[str, float]] = {}
    for s, k, v in rows:
        out.setdefault(s, {})[k] = v
    return out
