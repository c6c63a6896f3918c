"""Metric series, downsampled on the server, and the newest value of each."""

from __future__ import annotations

from typing import Annotated

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
    body = MetricsOut.model_validate({"job_id": job.id, "keys": found.keys, "series": found.series},
                                     from_attributes=True)
    # serialised once here: returning the model would validate all of it a second time
    return Response(body.model_dump_json(), media_type="application/json", headers=cache_headers(etag))


@router.get("/{job_id}/metrics/latest", response_model=dict[str, LatestPoint], responses=NOT_MODIFIED)
def job_metrics_latest(job: JobDep, session: SessionDep, _unchanged: JobETag):
    return metrics_q.latest(session, job_id=job.id)
