"""Response models of the API."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from service.core.fingerprint import Fingerprint
from service.core.health import JobHealth
from service.core.records import without_cluster
from service.core.sparsity import SparsityReport
from service.core.specs import JobSpec


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class FieldError(BaseModel):
    field: str  # dotted path in the spec or query, e.g. `grpo.num_generations`; "" for the whole body
    message: str
    type: str | None = None
    loc: list[str | int]  # pydantic's location, e.g. ["body", "grpo", "grpo", "num_generations"]


class ValidationErrorOut(BaseModel):
    """Every 422: each problem with the field it names, and a one-line summary."""

    detail: list[FieldError]
    message: str


class ErrorOut(BaseModel):
    """Every other error (401, 404, 409, 413, 429, 503): what is wrong, in a sentence."""

    detail: str


def error_responses(*codes: int) -> dict[int | str, dict]:
    """OpenAPI `responses` for the error statuses a route can send, in the shapes sent."""
    what = {401: "Missing, invalid, revoked or expired API key.",
            404: "No such job, file or checkpoint for this key's owner.",
            409: "The job, file or training run is in a state that does not allow this (the detail says which).",
            413: "The request body is over the limit, or an uploaded file is over one of its budgets (rows, "
                 "bytes per row, decoded bytes, memory, time: the detail names the setting).",
            429: "Too many uploads are being checked at once, for this owner or this API process; retry after "
                 "`Retry-After` seconds.",
            422: "The request names a field wrongly; nothing was stored.",
            503: "The store (or the job queue) is unreachable; retry after `Retry-After` seconds."}
    return {c: {"model": ValidationErrorOut if c == 422 else ErrorOut, "description": what[c]} for c in codes}


OCTET_STREAM = "application/octet-stream"


def binary_content(media: str, *more: str) -> dict:
    """OpenAPI `content` of a download: its own media types, and application/octet-stream, the one
    every generated client reads as bytes (sent to a client that accepts only that: `download_type`)."""
    return {m: {"schema": {"type": "string", "format": "binary"}} for m in (media, *more, OCTET_STREAM)}


def download_type(accept: str, media: str) -> str:
    """`media`, unless the Accept header asks for application/octet-stream and not for `media`."""
    return OCTET_STREAM if OCTET_STREAM in accept and media not in accept else media


class LatestPoint(BaseModel):
    step: int
    value: float


class HealthFlagOut(BaseModel):
    """A guard's level from a step on (service/core/health.py says what each guard reads)."""

    level: Literal["ok", "warn", "critical"]
    step: int | None
    value: float | None
    threshold: float | None  # the threshold the value is at or past (null: within its band)
    message: str


class HealthOut(BaseModel):
    """A job's health at a glance: the worst current level, and each of its kind's guards with its
    latest flag (null: never flagged, so ok)."""

    level: Literal["ok", "warn", "critical"]
    guards: dict[str, HealthFlagOut | None]

    @classmethod
    def of(cls, summary: JobHealth) -> HealthOut:
        return cls(level=summary.level, guards={g: None if f is None else HealthFlagOut(
            level=f.level, step=f.step, value=f.value, threshold=f.threshold, message=f.message)
            for g, f in summary.guards.items()})


class JobOut(_Out):
    id: int
    uid: str
    owner: str
    name: str | None
    kind: str
    status: str
    step: int
    total_steps: int
    attempt: int
    cancel_requested: bool
    gpus: int = Field(description="GPUs it needs on one worker, from its devices: 0 runs on any worker (its GPU "
                      "where it has one); more waits for a worker that has them (GET /v1/workers).")
    error: str | None
    spec: JobSpec  # as submitted, every default filled in
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    latest: dict[str, LatestPoint] | None = None  # only on lists that ask for it with `latest=`
    health: HealthOut | None = None  # on GET /v1/jobs/{id}: its health guards' latest flags
    fingerprint: Fingerprint | None = None  # on GET /v1/jobs/{id}, once an attempt started: what it ran

    @field_validator("spec", mode="wrap")
    @classmethod
    def _stored(cls, v: Any, handler):
        # A row stored by an older version that this one no longer accepts is shown as it was
        # stored rather than failing every page it is on (its worker fails it with the reason).
        try:
            return handler(v)
        except ValidationError:
            return v


class JobPage(BaseModel):
    items: list[JobOut]
    has_more: bool
    next_after: int | None


class EventOut(_Out):
    id: int
    type: str
    level: str
    message: str
    data: dict[str, Any] | None = Field(description="The event's facts; those that name the cluster (`holder`, "
                                        "`node_name`, `hostname`, `server_url`, `log`) only for the admin's keys "
                                        "(GRPO_ADMIN_OWNERS).")
    created_at: datetime


def event_out(event, *, admin: bool) -> EventOut:
    """A stored event as its reader may see it: the admin all of it, a tenant nothing that names the cluster."""
    out = EventOut.model_validate(event)
    return out if admin else out.model_copy(update={"data": without_cluster(out.data)})


class Point(BaseModel):
    step: int
    value: float
    min: float
    max: float


class Series(BaseModel):
    key: str
    points: list[Point]
    downsampled: bool
    total_points: int
    bucket_steps: int | None = None


class MetricsOut(BaseModel):
    job_id: int
    keys: list[str]
    series: list[Series]


class SelectionOut(_Out):
    id: int
    step: int
    policy: str
    total: int
    selected: int
    ratio: float
    mean_influence: float
    min_influence: float
    max_influence: float
    histogram: dict[str, Any]
    scores: list[Any] | None = None


class IntervalOut(_Out):
    estimate: float
    low: float = Field(description="Lower bound of the 95% interval.")
    high: float = Field(description="Upper bound of the 95% interval.")


class CorrelationOut(_Out):
    """How well a prediction tracks the actual change over n steps; null where undefined (fewer than 3
    steps, or a constant series). Intervals: 95% paired percentile bootstrap over steps, 2,000 resamples."""

    n: int
    pearson: IntervalOut | None
    spearman: IntervalOut | None


class PredictionPoint(BaseModel):
    step: int
    predicted: float = Field(description="tracin/predicted_delta: <G_val, theta_{t+1} - theta_t>.")
    predicted_trapezoid: float | None = Field(
        description="tracin/predicted_delta_trapezoid: 1/2 <G_val(theta_t) + G_val(theta_{t+1}), theta_{t+1} - "
        "theta_t>, exact for a quadratic objective (null on steps recorded before it was measured).")
    predicted_sgd: float | None = Field(description="tracin/predicted_delta_sgd: -lr * (sum of the selected "
                                        "samples' influence, in the job's tracin.score geometry).")
    actual: float = Field(description="tracin/actual_delta: L_val(theta_{t+1}) - L_val(theta_t).")


class PredictionCheckOut(BaseModel):
    """TracIn's first-order prediction of each step's change of the validation objective against the change
    that happened, and their correlation over the job's steps so far."""

    job_id: int
    points: list[PredictionPoint] = Field(description="Every step with an update, by step: the values the "
                                          "correlations are computed from (also served as metrics).")
    update: CorrelationOut = Field(description="predicted (from the actual parameter update) against actual.")
    trapezoid: CorrelationOut = Field(description="predicted_trapezoid against actual: where it tracks the actual "
                                      "change and the first order does not, the first order's gap is curvature, "
                                      "not noise.")
    influence: CorrelationOut = Field(description="predicted_sgd (from the influence scores) against actual.")


class SparsityOut(_Out):
    id: int
    step: int
    from_step: int
    scope: str
    sparsity: float
    report: SparsityReport | None = None


class SampleOut(_Out):
    id: int
    step: int
    index: int
    prompt: str
    completion: str
    reward: float | None  # null for a session run's samples: its client grades them
    advantage: float | None
    influence: float | None
    selected: bool | None
    extra: dict[str, Any] | None


class CheckpointOut(_Out):
    """A checkpoint, by job and step (where it is stored is the server's business)."""

    id: int
    step: int
    format: str
    size_bytes: int
    created_at: datetime


class FileOut(_Out):
    """An uploaded data file."""

    id: str  # "file-..." : name it in a spec's dataset.train_file / val_file / corpus_file
    purpose: str  # train, eval or corpus
    filename: str
    format: str  # jsonl or parquet
    bytes: int
    rows: int
    columns: list[str]
    sha256: str
    created_at: datetime


class FilePage(BaseModel):
    items: list[FileOut]
    has_more: bool
    next_after: str | None  # pass as `after` for the next page
