"""Metric series: upserted points and server-side downsampling.

Downsampling buckets the step range into at most `max_points` equal-width buckets and returns,
per bucket, the mean with the bucket's min and max, so a one-step spike in a 100,000-step run
still shows in a 1,000-point chart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sqlalchemy import bindparam, func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.store.models import Metric, MetricKey, utcnow

# name -> id per database; ids never change once written, so a process may cache them.
_KEY_IDS: dict[str, dict[str, int]] = {}

_PG_UPSERT = text("""
INSERT INTO metrics (job_id, key_id, step, value, created_at)
SELECT j, k, s, v, :now FROM unnest(CAST(:j AS integer[]), CAST(:k AS integer[]), CAST(:s AS integer[]),
                                    CAST(:v AS double precision[])) AS t(j, k, s, v)
ON CONFLICT (job_id, key_id, step) DO UPDATE SET value = excluded.value, created_at = excluded.created_at
""")


def _is_pg(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def key_ids(session: Session, *, names: Iterable[str], create: bool) -> dict[str, int]:
    """Ids of metric names; with `create`, names not seen before are added."""
    cache = _KEY_IDS.setdefault(str(session.get_bind().url), {})
    names = set(names)
    missing = names - cache.keys()
    if missing and create:
        insert = pg_insert if _is_pg(session) else sqlite_insert
        session.execute(insert(MetricKey).on_conflict_do_nothing(index_elements=["name"]),
                        [{"name": n} for n in sorted(missing)])
    if missing:
        cache.update(session.execute(select(MetricKey.name, MetricKey.id).where(MetricKey.name.in_(missing))).all())
    return {n: cache[n] for n in names if n in cache}


def upsert_points(session: Session, *, rows: Iterable[tuple[int, str, int, float]]) -> int:
    """Write (job_id, key, step, value) rows; an existing (job_id, key, step) is overwritten.

    NaN and inf are never stored (a loop reports them as events). On PostgreSQL a batch is one
    statement over arrays (unnest), several times faster than executemany.
    """
    latest: dict[tuple[int, str, int], float] = {}
    for j, k, s, v in rows:  # one row per key and step: a statement may not update a row twice
        if v is not None and math.isfinite(v := float(v)):
            latest[(j, k, s)] = v
    if not latest:
        return 0
    ids = key_ids(session, names={k for _, k, _ in latest}, create=True)
    now = utcnow()
    if _is_pg(session):
        keys = list(latest)
        session.execute(_PG_UPSERT, {"j": [x[0] for x in keys], "k": [ids[x[1]] for x in keys],
                                     "s": [x[2] for x in keys], "v": list(latest.values()), "now": now})
    else:
        stmt = sqlite_insert(Metric)
        stmt = stmt.on_conflict_do_update(
            index_elements=["job_id", "key_id", "step"],
            set_={"value": stmt.excluded.value, "created_at": stmt.excluded.created_at},
        )
        session.execute(stmt, [{"job_id": j, "key_id": ids[k], "step": s, "value": v, "created_at": now}
                               for (j, k, s), v in latest.items()])
    return len(latest)


def upsert_step(session: Session, *, job_id: int, step: int, values: Mapping[str, float]) -> int:
    return upsert_points(session, rows=((job_id, k, step, v) for k, v in values.items()))


def list_keys(session: Session, *, job_id: int) -> list[str]:
    used = select(Metric.key_id).where(Metric.job_id == job_id).distinct().subquery()
    return list(session.scalars(select(MetricKey.name).join(used, MetricKey.id == used.c.key_id)
                                .order_by(MetricKey.name)))


@dataclass
class SeriesData:
    """One series between two steps, at most `max_points` points ({step, value, min, max})."""

    key: str
    points: list[dict] = field(default_factory=list)
    downsampled: bool = False
    total_points: int = 0
    bucket_steps: int | None = None


@dataclass
class JobSeries:
    keys: list[str]  # every metric name the job has, sorted
    series: list[SeriesData]  # in the order asked for


# Every series of a job (or the named ones) bucketed per key, plus the job's key names, in one
# statement, every step of it an index probe or range scan on the primary key (job_id, key_id,
# step): the job's keys by a loose index scan (one probe per key, not a pass over its points),
# each series' first and last step in range by two probes, then its points in one range scan.
# A series spanning n steps gets width ceil(n / :m) (1 when it fits: one point per step);
# integer division buckets it, and each bucket keeps its mean, min and max.
_SERIES_SQL = """
WITH RECURSIVE job_keys(key_id) AS (
  SELECT (SELECT key_id FROM metrics WHERE job_id = :job ORDER BY key_id LIMIT 1)
  UNION ALL
  SELECT (SELECT m.key_id FROM metrics m WHERE m.job_id = :job AND m.key_id > k.key_id ORDER BY m.key_id LIMIT 1)
  FROM job_keys k WHERE k.key_id IS NOT NULL
), ends AS (
  SELECT k.key_id,
    (SELECT m.step FROM metrics m WHERE m.job_id = :job AND m.key_id = k.key_id AND m.step >= :lo AND m.step <= :hi
     ORDER BY m.step LIMIT 1) AS first,
    (SELECT m.step FROM metrics m WHERE m.job_id = :job AND m.key_id = k.key_id AND m.step >= :lo AND m.step <= :hi
     ORDER BY m.step DESC LIMIT 1) AS last
  FROM job_keys k WHERE k.key_id IS NOT NULL {key_filter}
), bounds AS MATERIALIZED (
  SELECT key_id, first, (last - first + :m) / :m AS width FROM ends WHERE first IS NOT NULL
), agg AS (
  SELECT m.key_id, b.width, MIN(m.step) AS step, AVG(m.value) AS value, MIN(m.value) AS vmin, MAX(m.value) AS vmax,
         COUNT(*) AS n
  FROM bounds b JOIN metrics m ON m.job_id = :job AND m.key_id = b.key_id AND m.step >= :lo AND m.step <= :hi
  GROUP BY m.key_id, b.width, (m.step - b.first) / b.width
)
SELECT mk.name, agg.width, agg.step, agg.value, agg.vmin, agg.vmax, agg.n
FROM agg JOIN metric_keys mk ON mk.id = agg.key_id
UNION ALL
SELECT mk.name, NULL, NULL, NULL, NULL, NULL, NULL FROM job_keys k JOIN metric_keys mk ON mk.id = k.key_id
"""
_SERIES_ALL = text(_SERIES_SQL.format(key_filter=""))
_SERIES_NAMED = text(_SERIES_SQL.format(
    key_filter="AND k.key_id IN (SELECT id FROM metric_keys WHERE name IN :names)"
)).bindparams(bindparam("names", expanding=True))
_MIN_STEP, _MAX_STEP = -(2**31), 2**31 - 1


def job_series(
    session: Session, *, job_id: int, keys: list[str] | None = None, from_step: int | None = None,
    to_step: int | None = None, max_points: int = 1000,
) -> JobSeries:
    """The series of `keys` (default: all) between from_step and to_step (inclusive), each at most
    `max_points` points, and the names of all the job's series: one SQL statement."""
    params = {"job": job_id, "lo": _MIN_STEP if from_step is None else from_step,
              "hi": _MAX_STEP if to_step is None else to_step, "m": max_points}
    if keys is not None:
        rows = session.execute(_SERIES_NAMED, {**params, "names": list(keys) or [""]}).all()
    else:
        rows = session.execute(_SERIES_ALL, params).all()
    all_keys: list[str] = []
    found: dict[str, SeriesData] = {}
    for name, width, step, avg, vmin, vmax, count in rows:
        if width is None:
            all_keys.append(name)
            continue
        sd = found.setdefault(name, SeriesData(key=name))
        sd.points.append({"step": int(step), "value": float(avg), "min": float(vmin), "max": float(vmax)})
        sd.total_points += count
        if width > 1:
            sd.downsampled, sd.bucket_steps = True, width
    for sd in found.values():
        sd.points.sort(key=lambda p: p["step"])
    all_keys.sort()
    wanted = all_keys if keys is None else keys
    return JobSeries(keys=all_keys, series=[found.get(k) or SeriesData(key=k) for k in wanted])


def series(
    session: Session, *, job_id: int, key: str, from_step: int | None = None, to_step: int | None = None,
    max_points: int = 1000,
) -> SeriesData:
    """One series (see job_series)."""
    return job_series(session, job_id=job_id, keys=[key], from_step=from_step, to_step=to_step,
                      max_points=max_points).series[0]


def latest(session: Session, *, job_id: int) -> dict[str, dict]:
    """The newest point of every series of a job."""
    return latest_of(session, job_ids=[job_id]).get(job_id, {})


def latest_of(session: Session, *, job_ids: Iterable[int], keys: Iterable[str] | None = None) -> dict[int, dict[str, dict]]:
    """The newest point of each of `keys` (default: every series) for each job:
    {job_id: {key: {step, value}}}."""
    job_ids = list(job_ids)
    if not job_ids:
        return {}
    where = [Metric.job_id.in_(job_ids)]
    if keys is not None:
        ids = key_ids(session, names=keys, create=False)
        if not ids:
            return {}
        where.append(Metric.key_id.in_(list(ids.values())))
    newest = (select(Metric.job_id, Metric.key_id, func.max(Metric.step).label("step"))
              .where(*where).group_by(Metric.job_id, Metric.key_id).subquery())
    rows = session.execute(
        select(Metric.job_id, MetricKey.name, Metric.step, Metric.value)
        .join(newest, (Metric.job_id == newest.c.job_id) & (Metric.key_id == newest.c.key_id)
              & (Metric.step == newest.c.step))
        .join(MetricKey, MetricKey.id == Metric.key_id)
    ).all()
    out: dict[int, dict[str, dict]] = {}
    for j, k, st, v in rows:
        out.setdefault(j, {})[k] = {"step": st, "value": v}
    return out


def _by_step(session: Session, *where) -> dict[int, dict[str, float]]:
    """Every point matching `where`, undownsampled, grouped by step in step order."""
    rows = session.execute(
        select(Metric.step, MetricKey.name, Metric.value).join(MetricKey, MetricKey.id == Metric.key_id)
        .where(*where).order_by(Metric.step)
    ).all()
    out: dict[int, dict[str, float]] = {}
    for s, k, v in rows:
        out.setdefault(s, {})[k] = v
    return out


def points_between(session: Session, *, job_id: int, after_step: int, to_step: int) -> dict[int, dict[str, float]]:
    """All points with after_step < step <= to_step, grouped by step (for live streams)."""
    return _by_step(session, Metric.job_id == job_id, Metric.step > after_step, Metric.step <= to_step)


def values_by_step(session: Session, *, job_id: int, keys: Iterable[str]) -> dict[int, dict[str, float]]:
    """Every recorded value of `keys`, undownsampled, grouped by step in step order."""
    return _by_step(session, Metric.job_id == job_id, MetricKey.name.in_(list(keys)))
