"""Jobs: submit, list, inspect, cancel and events (the live stream is in stream.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Header, HTTPException, Query, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from service.api.conditional import NOT_MODIFIED, IfNoneMatch, JobETag, check, rows_etag
from service.api.deps import MAX_INT, JobDep, OwnerDep, SeesClusterDep, SessionDep, SettingsDep
from service.api.schemas import EventOut, HealthOut, JobOut, JobPage, LatestPoint, error_responses, event_out
from service.api.sources import check_sources
from service.core import fingerprint, health, queue
from service.core.artifacts import open_store
from service.core.errors import format_errors
from service.core.specs import KINDS, STATUSES, TERMINAL, Status, SubmittedSpec
from service.store import events as events_q
from service.store import jobs as jobs_q
from service.store import leases
from service.store import metrics as metrics_q
from service.store import workers as workers_q

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 422, 503))


@router.post("", status_code=201, response_model=JobOut, responses=error_responses(413))
def submit_job(
    spec: Annotated[SubmittedSpec, Body(description="A job spec, discriminated on `kind`.")],
    owner: OwnerDep, session: SessionDep, settings: SettingsDep, response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=200,
                               description="Retrying with the same key returns the same job.")] = None,
):
    if errors := check_sources(spec, settings, session=session, owner=owner):  # a refused spec stores nothing
        return JSONResponse(format_errors(errors), status_code=422)
    submitted = leases.submit_job(settings.store_url, owner=owner, spec=spec, idempotency_key=idempotency_key)
    job = submitted.job
    if not submitted.created:
        response.headers["Idempotent-Replayed"] = "true"
        return job
    try:
        queue.enqueue(queue.Message(job.id, job.uid, job.gpus), broker_url=settings.broker)
    except Exception as exc:  # broker down: fail the job visibly rather than leave it queued forever
        message = f"could not enqueue the job: {type(exc).__name__}"
        leases.finish_job(settings.store_url, job_id=job.id, holder=None, status=Status.failed, message=message,
                          error=message)
        raise HTTPException(503, "the job queue is unreachable; the job was recorded as failed") from exc
    if job.gpus and (why := workers_q.why_waiting(session, gpus=job.gpus, within_s=settings.lease_timeout_s)):
        events_q.add_event(session, job_id=job.id, type="waiting", level="warning", message=why,
                           data={"gpus": job.gpus, "queue": queue.queue_for(job.gpus)})
    return job


@router.get("", response_model=JobPage, responses=NOT_MODIFIED)
def list_jobs(
    owner: OwnerDep, session: SessionDep, response: Response, if_none_match: IfNoneMatch = None,
    status: Annotated[Literal[STATUSES] | None, Query(description="Only jobs in this status.")] = None,  # type: ignore[valid-type]
    kind: Annotated[Literal[KINDS] | None, Query(description="Only jobs of this kind.")] = None,  # type: ignore[valid-type]
    after: Annotated[int | None, Query(ge=0, le=MAX_INT, description="Cursor: the `next_after` of the previous page.")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    latest: Annotated[str | None, Query(max_length=1000, description="Comma-separated metric names: each job "
                                        "carries the newest point of each, e.g. `reward/mean`.")] = None,
):
    rows, has_more = jobs_q.list_jobs(session, owner=owner, status=status, kind=kind, after=after, limit=limit)
    wanted = [k.strip() for k in latest.split(",") if k.strip()] if latest else []
    # the newest points change only with a job's step or status, which its row carries
    check(rows_etag(rows, has_more, wanted), if_none_match, response)
    items = [JobOut.model_validate(r) for r in rows]
    if wanted:
        newest = metrics_q.latest_of(session, job_ids=[j.id for j in items], keys=wanted)
        for j in items:
            j.latest = {k: LatestPoint(**v) for k, v in newest.get(j.id, {}).items()}
    return JobPage(items=items, has_more=has_more, next_after=items[-1].id if has_more and items else None)


@router.get("/{job_id}", response_model=JobOut, responses=error_responses(404) | NOT_MODIFIED)
def get_job(job: JobDep, session: SessionDep, _unchanged: JobETag):
    """The job, with its health (each guard's latest flag and the worst level) and the fingerprint of
    its latest attempt (what it ran: spec, code, libraries, hardware, seeds, data and weights)."""
    out = JobOut.model_validate(job)
    out.health = HealthOut.of(health.summarise(job.kind, events_q.health_flags(session, job_id=job.id)))
    if (data := events_q.latest_data(session, job_id=job.id, type=fingerprint.EVENT)) is not None:
        try:
            out.fingerprint = fingerprint.Fingerprint.model_validate(data)
        except ValidationError:  # recorded by another version: the event still holds it
            pass
    return out


@router.post("/{job_id}/cancel", response_model=JobOut, responses=error_responses(404, 409, 413))
def cancel_job(job: JobDep, session: SessionDep, settings: SettingsDep):
    if job.status in TERMINAL:
        raise HTTPException(409, f"job {job.id} already {job.status}")
    return jobs_q.request_cancel(session, job=job, lease_timeout_s=settings.lease_timeout_s)


@router.delete("/{job_id}", status_code=204, response_class=Response, responses=error_responses(404, 409, 413))
def delete_job(job: JobDep, session: SessionDep, settings: SettingsDep) -> Response:
    """Delete a finished job: its events, metric points, samples, selections, sparsity reports,
    checkpoint rows and its checkpoint files. Files it trained on stay (they are yours to delete)."""
    if job.status not in TERMINAL:
        raise HTTPException(409, f"job {job.id} is {job.status}: cancel it, and delete it once it is cancelled")
    if users := [j.id for j in jobs_q.active_jobs(session, owner=job.owner) if _starts_from(j, job.id)]:
        raise HTTPException(409, f"job {job.id}'s checkpoints are the starting point (model.init_from) of "
                            f"unfinished job(s) {', '.join(map(str, users))}")
    jobs_q.delete_job(session, job=job)
    open_store(settings).delete(job.uid)  # before the commit: if the store fails, the rows stay (503, retry)
    return Response(status_code=204)


def _starts_from(job, earlier: int) -> bool:
    spec = job.job_spec()
    return spec is not None and spec.model.init_from is not None and spec.model.init_from.job == earlier


@router.get("/{job_id}/events", response_model=list[EventOut], responses=error_responses(404) | NOT_MODIFIED)
def job_events(job: JobDep, session: SessionDep, admin: SeesClusterDep, _unchanged: JobETag,
               after_id: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
               limit: Annotated[int, Query(ge=1, le=1000)] = 500):
    """The job's events, oldest first; what names the cluster's hosts and processes only to the admin's keys."""
    return [event_out(e, admin=admin) for e in events_q.list_events(session, job_id=job.id, after_id=after_id,
                                                                     limit=limit)]
