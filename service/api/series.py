"""Metric series, downsampled on the server, and the newest value of each."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from service.api.deps import MAX_INT, JobDep, SessionDep
from service.api.schemas import LatestPoint, MetricsOut, error_responses
from service.store import metrics as metrics_q

router = APIRouter(prefix="/v1/jobs", tags=["metrics"], responses=error_responses(401, 404, 422, 503))


@router.get("/{job_id}/metrics", response_model=MetricsOut)
def job_metrics(
    job: JobDep, session: SessionDep,
    keys: Annotated[str | None, Query(description="Comma-separated metric names; default all.")] = None,
    from_step: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    to_step: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    max_points: Annotated[int, Query(ge=2, le=100_000, description="Longer series are bucketed: "
                                     "mean per bucket with its min and max, so spikes stay visible.")] = 1000,
):
    wanted = list(dict.fromkeys(k.strip() for k in keys.split(",") if k.strip())) if keys else None
    found = metrics_q.job_series(session, job_id=job.id, keys=wanted, from_step=from_step, to_step=to_step,
                                 max_points=max_points)
    body = MetricsOut.model_validate({"job_id": job.id, "keys": found.keys, "series": found.series},
                                     from_attributes=True)
    # serialised once here: returning the model would validate all of it a second time
    return Response(body.model_dump_json(), media_type="application/json")


@router.get("/{job_id}/metrics/latest", response_model=dict[str, LatestPoint])
def job_metrics_latest(job: JobDep, session: SessionDep):
    return metrics_q.latest(session, job_id=job.id)
