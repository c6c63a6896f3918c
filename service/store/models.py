"""SQLAlchemy 2 models: the one place the schema is declared (Alembic migrates to it)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    String,
    Text,
    UniqueConstraint,
    or_,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from service.core.specs import JobSpec, Status, parse_stored_spec


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_uid() -> str:
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite hands back naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value, dialect):
        return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict: JSON, list: JSON}


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        UniqueConstraint("uid", name="uq_jobs_uid"),
        Index("ix_jobs_owner_id", "owner", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Globally unique: ids restart at 1 in a new store, so artifacts and broker messages use this.
    uid: Mapped[str] = mapped_column(String(32), default=new_uid)
    owner: Mapped[str] = mapped_column(String(200))
    name: Mapped[str | None] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(20))
    spec: Mapped[dict]
    status: Mapped[str] = mapped_column(String(20), default="queued", index=True)
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    gpus: Mapped[int] = mapped_column(Integer, default=0)  # needed on one worker (its queue); from the spec's devices
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    heartbeat_at: Mapped[datetime | None]
    error: Mapped[str | None] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    def job_spec(self) -> JobSpec | None:
        """The stored spec as the typed spec it was submitted as; None for one this version no
        longer accepts (the worker fails such a job with the reason)."""
        try:
            return parse_stored_spec(self.spec)
        except ValidationError:
            return None

    @classmethod
    def lease_stale(cls, now: datetime, lease_timeout_s: float):
        """SQL: a running job whose holder has not renewed its lease within the timeout."""
        return (cls.status == Status.running) & or_(
            cls.heartbeat_at.is_(None), cls.heartbeat_at < now - timedelta(seconds=lease_timeout_s))


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(40))
    level: Mapped[str] = mapped_column(String(10), default="info")
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class MetricKey(Base):
    """Metric names, stored once: the points table keys on a small integer, not a string."""

    __tablename__ = "metric_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(120), unique=True)


class Metric(Base):
    """One point of one series. (job_id, key_id, step) is the primary key: writes are upserts.

    The primary key INCLUDEs the value on PostgreSQL, so a series query is an index-only scan.
    No foreign keys: they cost ~45% of ingest throughput, and only the worker holding a job's
    lease writes its points.
    """

    __tablename__ = "metrics"
    __table_args__ = (
        PrimaryKeyConstraint("job_id", "key_id", "step", name="pk_metrics", postgresql_include=["value"]),
        # serves live streams ("points after step N") and "latest"
        Index("ix_metrics_job_step", "job_id", "step"),
    )

    job_id: Mapped[int] = mapped_column(Integer)
    key_id: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    value: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Selection(Base):
    __tablename__ = "selections"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_selections_job_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    policy: Mapped[str] = mapped_column(String(20))
    total: Mapped[int] = mapped_column(Integer)
    selected: Mapped[int] = mapped_column(Integer)
    ratio: Mapped[float] = mapped_column(Float)
    mean_influence: Mapped[float] = mapped_column(Float)
    min_influence: Mapped[float] = mapped_column(Float)
    max_influence: Mapped[float] = mapped_column(Float)
    histogram: Mapped[dict]
    scores: Mapped[list]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class SparsityReport(Base):
    __tablename__ = "sparsity_reports"
    __table_args__ = (UniqueConstraint("job_id", "step", "scope", name="uq_sparsity_job_step_scope"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    from_step: Mapped[int] = mapped_column(Integer)
    scope: Mapped[str] = mapped_column(String(20), default="window")
    sparsity: Mapped[float] = mapped_column(Float)
    report: Mapped[dict]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Sample(Base):
    __tablename__ = "samples"
    __table_args__ = (Index("ix_samples_job_step", "job_id", "step"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    index: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(Text)
    completion: Mapped[str] = mapped_column(Text)
    reward: Mapped[float | None] = mapped_column(Float)  # None: graded by the client (session runs)
    advantage: Mapped[float | None] = mapped_column(Float)
    influence: Mapped[float | None] = mapped_column(Float)
    selected: Mapped[bool | None] = mapped_column(Boolean)
    extra: Mapped[dict | None]


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(20))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner: Mapped[str] = mapped_column(String(200), index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    expires_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


class DataFile(Base):
    """An uploaded data file; its bytes are in the artifact store under `key`."""

    __tablename__ = "files"
    __table_args__ = (UniqueConstraint("id", name="uq_files_id"), Index("ix_files_owner_pk", "owner", "pk"))

    pk: Mapped[int] = mapped_column(Integer, primary_key=True)  # orders pages; never shown
    id: Mapped[str] = mapped_column(String(40), default=new_file_id)
    owner: Mapped[str] = mapped_column(String(200))
    purpose: Mapped[str] = mapped_column(String(20))
    filename: Mapped[str] = mapped_column(String(255))
    format: Mapped[str] = mapped_column(String(20))
    bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    columns: Mapped[list]
    sha256: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


def new_session_id() -> str:
    return "sess-" + uuid.uuid4().hex[:24]


class TinkerSession(Base):
    """A tinker SDK client's session: it holds training runs (session jobs) and lives while the
    client heartbeats."""

    __tablename__ = "tinker_sessions"
    __table_args__ = (Index("ix_tinker_sessions_owner_created", "owner", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=new_session_id)
    owner: Mapped[str] = mapped_column(String(200))
    tags: Mapped[list]
    user_metadata: Mapped[dict]
    sdk_version: Mapped[str] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class SessionCheckpoint(Base):
    """A tinker name for a session run's checkpoint: `tinker://<model_id>/<kind>/<name>` is step `step`'s
    folder (several names may share one)."""

    __tablename__ = "session_checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "kind", "name", name="uq_session_checkpoints_job_kind_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(20))  # weights (a state, with the optimizer) | sampler_weights
    name: Mapped[str] = mapped_column(String(100))
    step: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class SessionOp(Base):
    """One operation a tinker client sent to a session job, and its result once the worker ran
    it: the future the client polls. The worker runs a job's pending operations in `seq` order."""

    __tablename__ = "session_ops"
    __table_args__ = (UniqueConstraint("request_id", name="uq_session_ops_request_id"),
                      Index("ix_session_ops_job_status_seq", "job_id", "status", "seq"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(40))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(30))
    body: Mapped[bytes] = mapped_column(LargeBinary)  # the request as sent (forward_backward: protobuf)
    status: Mapped[str] = mapped_column(String(10), default="pending")  # pending | done | failed
    result: Mapped[bytes | None] = mapped_column(LargeBinary)
    result_format: Mapped[str | None] = mapped_column(String(10))  # proto | json
    error: Mapped[str | None] = mapped_column(Text)
    category: Mapped[str | None] = mapped_column(String(10))  # the SDK's RequestErrorCategory: user | server
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class Webhook(Base):
    """An owner's URL that gets a signed POST when one of their jobs ends or raises a red health flag."""

    __tablename__ = "webhooks"
    __table_args__ = (Index("ix_webhooks_owner_id", "owner", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(Text)  # canonical form (service/core/grader_urls.py)
    events: Mapped[list] = mapped_column(JSON)  # the event types it is sent (service/core/webhooks.py)
    secret: Mapped[str] = mapped_column(String(80))  # the HMAC key of its signatures, shown once at creation
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    """One event for one webhook, and how its delivery went: pending until a 2xx answer, retried with
    backoff, failed after the last attempt."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_status_next", "status", "next_attempt_at"),
                      Index("ix_webhook_deliveries_webhook_id", "webhook_id", "id"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    webhook_id: Mapped[int] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    job_id: Mapped[int] = mapped_column(Integer)  # kept when the job is deleted: the delivery happened
    event: Mapped[str] = mapped_column(String(40))
    payload: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(10), default="pending")  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_status: Mapped[int | None] = mapped_column(Integer)  # the last answer's HTTP status
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None]


class Worker(Base):
    """A running worker (its Celery main process) as it last said: the GPUs it has and the queues it consumes.
    It says so every sweep; a row not renewed within the lease timeout is a worker that is gone."""

    __tablename__ = "workers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)  # hostname:pid:random of its main process
    hostname: Mapped[str] = mapped_column(String(200))
    gpus: Mapped[list] = mapped_column(JSON)  # [{index, name, memory_bytes}], worker/machine/inventory.py
    queues: Mapped[list] = mapped_column(JSON)
    concurrency: Mapped[int] = mapped_column(Integer)  # jobs it runs at once
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    seen_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class JobNode(Base):
    """A node of a multi-node job's attempt: the worker that took it. Node 0 is the worker that leased the job
    and hosts its rendezvous. One row per node and per node name in an attempt, so a redelivered message never
    joins twice and no two nodes of one attempt run on workers that say they are the same machine."""

    __tablename__ = "job_nodes"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "node_name", name="uq_job_nodes_node_name"),)

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_name: Mapped[str] = mapped_column(String(200))  # the worker's GRPO_NODE_NAME (or hostname)
    holder: Mapped[str] = mapped_column(String(200))  # the worker process that runs the node's ranks
    joined_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)  # renewed by the node while its ranks run
