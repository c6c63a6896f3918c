"""TracIn selections, sparsity reports, recorded samples and checkpoints."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import StreamingResponse

from service.api.conditional import NOT_MODIFIED, JobETag
from service.api.deps import MAX_INT, JobDep, SessionDep, SettingsDep
from service.api.schemas import (
    CheckpointOut,
    CorrelationOut,
    PredictionCheckOut,
    PredictionPoint,
    SampleOut,
    SelectionOut,
    SparsityOut,
    binary_content,
    download_type,
    error_responses,
)
from service.archive import downloadable, tar_gz
from service.core import evidence
from service.core.artifacts import checkpoint_key, open_store
from service.store import metrics as metrics_q
from service.store import records

PREDICTION_KEYS = ("tracin/predicted_delta", "tracin/predicted_delta_trapezoid", "tracin/predicted_delta_sgd",
                   "tracin/actual_delta")

router = APIRouter(prefix="/v1/jobs", tags=["reports"], responses=error_responses(401, 404, 422, 503))


@router.get("/{job_id}/selections", response_model=list[SelectionOut])
def job_selections(job: JobDep, session: SessionDep,
                   from_step: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
                   limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
                   scores: Annotated[bool, Query(description="Include per-sample scores.")] = True):
    rows = records.list_selections(session, job_id=job.id, from_step=from_step, limit=limit)
    out = [SelectionOut.model_validate(r) for r in rows]
    if not scores:
        for o in out:
            o.scores = None
    return out


@router.get("/{job_id}/tracin/prediction", response_model=PredictionCheckOut)
def tracin_prediction(job: JobDep, session: SessionDep):
    """Per step, the predicted and the actual change of the validation objective, and their correlations
    (empty for a job that records none: another kind, a baseline selection, or tracin.check_prediction off)."""
    rows = metrics_q.values_by_step(session, job_id=job.id, keys=PREDICTION_KEYS)
    points = [PredictionPoint(step=step, predicted=v["tracin/predicted_delta"], actual=v["tracin/actual_delta"],
                              predicted_trapezoid=v.get("tracin/predicted_delta_trapezoid"),
                              predicted_sgd=v.get("tracin/predicted_delta_sgd"))
              for step, v in rows.items() if "tracin/predicted_delta" in v and "tracin/actual_delta" in v]
    actual = [p.actual for p in points]
    with_sgd = [p for p in points if p.predicted_sgd is not None]
    with_trapezoid = [p for p in points if p.predicted_trapezoid is not None]
    return PredictionCheckOut(
        job_id=job.id, points=points,
        update=CorrelationOut.model_validate(evidence.correlation([p.predicted for p in points], actual)),
        trapezoid=CorrelationOut.model_validate(evidence.correlation([p.predicted_trapezoid for p in with_trapezoid],
                                                                     [p.actual for p in with_trapezoid])),
        influence=CorrelationOut.model_validate(evidence.correlation([p.predicted_sgd for p in with_sgd],
                                                                     [p.actual for p in with_sgd])))


@router.get("/{job_id}/sparsity", response_model=list[SparsityOut])
def job_sparsity(job: JobDep, session: SessionDep,
                 scope: Annotated[str | None, Query(pattern="^(window|cumulative)$")] = None,
                 full: Annotated[bool, Query(description="Include the whole report of each measurement.")] = True):
    out = [SparsityOut.model_validate(r) for r in records.list_sparsity(session, job_id=job.id, scope=scope)]
    if not full:
        for o in out:
            o.report = None
    return out


@router.get("/{job_id}/sparsity/{report_id}", response_model=SparsityOut)
def job_sparsity_report(job: JobDep, session: SessionDep, report_id: Annotated[int, Path(ge=1, le=MAX_INT)]):
    r = records.get_sparsity(session, job_id=job.id, report_id=report_id)
    if r is None:
        raise HTTPException(404, f"sparsity report {report_id} not found")
    return r


@router.get("/{job_id}/samples", response_model=list[SampleOut], responses=NOT_MODIFIED)
def job_samples(job: JobDep, session: SessionDep, _unchanged: JobETag,
                step: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
                after_id: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
                limit: Annotated[int, Query(ge=1, le=1000)] = 200):
    return records.list_samples(session, job_id=job.id, step=step, after_id=after_id, limit=limit)


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointOut], responses=NOT_MODIFIED)
def job_checkpoints(job: JobDep, session: SessionDep, _unchanged: JobETag):
    return records.list_checkpoints(session, job_id=job.id)


@router.get("/{job_id}/checkpoints/{step}/archive", response_class=StreamingResponse,
            responses={200: {"content": binary_content("application/gzip"),
                             "description": "A .tar.gz of folder `job-<id>-step-<step>/`: the peft adapter folder "
                             "(LoRA) or the transformers model folder, with the tokenizer. Sent as "
                             "`application/gzip`, or as `application/octet-stream` to a client that accepts only "
                             "that (generated clients know it as bytes)."}})
def checkpoint_archive(request: Request, job: JobDep, session: SessionDep, settings: SettingsDep,
                       step: Annotated[int, Path(ge=0, le=MAX_INT, description="The checkpoint's step.")]):
    if records.get_checkpoint(session, job_id=job.id, step=step) is None:
        raise HTTPException(404, f"job {job.id} has no checkpoint at step {step}")
    store, prefix = open_store(settings), checkpoint_key(job.uid, step)
    files = downloadable(store.list(prefix))
    if not files:
        raise HTTPException(404, f"the files of job {job.id}'s checkpoint at step {step} are gone from the artifact store")
    top = f"job-{job.id}-step-{step}"
    media = download_type(request.headers.get("accept", ""), "application/gzip")
    return StreamingResponse(tar_gz(store, prefix, files, top=top), media_type=media,
                             headers={"Content-Disposition": f'attachment; filename="{top}.tar.gz"'})
