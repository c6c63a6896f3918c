"""Metric series, downsampled on the server, and the newest value of each."""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, Query, Response

from service.api.conditional import NOT_MODIFIED, JobETag, cache_headers
from service.api.deps import MAX_INT, JobDep, SessionDep
from service.api.schemas import LatestPoint, MetricsOut, error_responses
from service.store import metrics as metrics_q

router = APIRouter(prefix="/v1/jobs", tags=["metrics"], responses=error_responses(401, 404, 422, 503))


@router.get("/{job_id}/metrics", response_model=MetricsOut, responses=NOT_MODIFIED)
def job_metrics(
    job: JobDep, session: SessionDep, etag: JobETag,
    keys: Annotated[str | None, Query(description="Comma-separated metric names; default all.")] = None,
    from_step: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    after_step: Annotated[int | None, Query(ge=-1, le=MAX_INT, description="Only points of later steps: the "
                                            "last step a poller has, to fetch what is new since.")] = None,
    to_step: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    max_points: Annotated[int, Query(ge=2, le=100_000, description="Longer series are bucketed: "
                                     "mean per bucket with its min and max, so spikes stay visible.")] = 1000,
):
    wanted = list(dict.fromkeys(k.strip() for k in keys.split(",") if k.strip())) if keys else None
    if after_step is not None:
        from_step = max(from_step or 0, after_step + 1)
    found = metrics_q.job_series(session, job_id=job.id, keys=wanted, from_step=from_step, to_step=to_step,
                                 max_points=max_points)
    return Response(metrics_body(job.id, found), media_type="application/json", headers=cache_headers(etag))


def metrics_body(job_id: int, found: metrics_q.JobSeries) -> bytes:
    """MetricsOut's JSON, byte for byte what `MetricsOut(...).model_dump_json()` gives, without a model per
    point: orjson writes the series' dataclasses as they are (fields in MetricsOut's order; floats shortest
    round-trip, NaN and infinities as null, as pydantic does). tests/service/api/test_series.py holds the
    two to the same bytes."""
    return orjson.dumps({"job_id": job_id, "keys": found.keys, "series": found.series})


@router.get("/{job_id}/metrics/latest", response_model=dict[str, LatestPoint], responses=NOT_MODIFIED)
def job_metrics_latest(job: JobDep, session: SessionDep, _unchanged: JobETag):
    return metrics_q.latest(session, job_id=job.id)
