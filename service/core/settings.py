"""Service and worker settings, read from the environment (pydantic-settings).

With nothing set, everything lives under one local data directory: the store is a SQLite
file and the broker is kombu's SQLAlchemy transport on another SQLite file, so `grpo-jobs dev`
needs no Redis, PostgreSQL or Docker. In production set DATABASE_URL and BROKER_URL.
"""

from __future__ import annotations

import socket
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.core.datafiles import Budget
from service.core.grader_urls import GraderUrl, parse_allow_list


def _split(v: str) -> list[str]:
    return [u.strip() for u in v.split(",") if u.strip()]


class Settings(BaseSettings):
    # A variable set to nothing is unset: `GRPO_MODELS_ROOT=` must not put a converted model in the current folder
    model_config = SettingsConfigDict(env_file=".env", extra="ignore", env_ignore_empty=True)

    data_dir: Path = Field(
        default=Path.home() / ".grpo-jobs",
        validation_alias="GRPO_DATA_DIR",
        description="Root for the embedded store, broker, checkpoints and model cache.",
    )
    database_url: str | None = Field(
        default=None, validation_alias="DATABASE_URL",
        description="SQLAlchemy URL of the store; default: SQLite file in data_dir.",
    )
    broker_url: str | None = Field(
        default=None, validation_alias="BROKER_URL",
        description="Celery broker URL; default: kombu SQLAlchemy transport on SQLite in data_dir.",
    )
    datasets_root: Path | None = Field(
        default=None, validation_alias="GRPO_DATASETS_ROOT",
        description="Directory of the owners' dataset folders: a job of owner O reads `jsonl` paths "
        "under <root>/O/; default data_dir/datasets.",
    )
    shared_datasets_root: Path | None = Field(
        default=None, validation_alias="GRPO_SHARED_DATASETS",
        description="A folder of datasets every owner may read, as `shared/...` in a spec; default none.",
    )
    model_roots_env: str = Field(
        default="", validation_alias="GRPO_MODEL_ROOTS",
        description="Colon-separated folders whose model folders a spec may name, relative to a root.",
    )
    reward_urls_env: str = Field(
        default="", validation_alias="GRPO_REWARD_URLS",
        description="Comma-separated URLs under which an `http` reward may call a grader, compared by scheme, "
        "host, port and path segments (service/core/grader_urls.py); empty: no `http` rewards.",
    )
    environment_urls_env: str = Field(
        default="", validation_alias="GRPO_ENVIRONMENT_URLS",
        description="Comma-separated URLs under which a job's `environment.url` may name an OpenEnv server, "
        "compared as GRPO_REWARD_URLS is; empty: bundled environments only.",
    )
    environment_max_message_bytes: int = Field(
        default=1 << 20, ge=1024, le=1 << 30, validation_alias="GRPO_ENVIRONMENT_MAX_MESSAGE_BYTES",
        description="The largest message a worker reads from an environment server; a larger answer ends the "
        "episode with an error.",
    )
    webhook_urls_env: str = Field(
        default="", validation_alias="GRPO_WEBHOOK_URLS",
        description="Comma-separated URLs under which an owner may register a webhook, compared as "
        "GRPO_REWARD_URLS is; empty: no webhooks.",
    )
    api_workers: int | None = Field(
        default=None, ge=1, le=64, validation_alias="GRPO_API_WORKERS",
        description="API processes `grpo-jobs serve` runs behind its port (its --workers wins). Unset: the "
        "machine's cores.",
    )
    admin_owners_env: str = Field(
        default="", validation_alias="GRPO_ADMIN_OWNERS",
        description="Comma-separated owners whose keys see the cluster: worker hostnames, processes and ports in "
        "/v1/workers, a job's nodes and its events. Every other key sees none of them.",
    )
    webhook_timeout_s: float = Field(
        default=10.0, gt=0, validation_alias="GRPO_WEBHOOK_TIMEOUT_S",
        description="Seconds a webhook receiver has for one delivery attempt, the whole exchange: connect, "
        "request, and the answer's status line and headers (its body is not read).",
    )
    reward_max_response_bytes: int = Field(
        default=4 * 1024 * 1024, gt=0, validation_alias="GRPO_REWARD_MAX_RESPONSE_BYTES",
        description="Largest answer read from an `http` grader; a longer one leaves its batch unscored.",
    )
    reward_auth_header: str = Field(
        default="Authorization", validation_alias="GRPO_REWARD_AUTH_HEADER",
        description="The header that carries the grader secret, when GRPO_REWARD_AUTH_ENV is set.",
    )
    reward_auth_env: str = Field(
        default="", validation_alias="GRPO_REWARD_AUTH_ENV",
        description="The name of the workers' environment variable whose value is sent in "
        "GRPO_REWARD_AUTH_HEADER to `http` graders (never taken from a spec); empty: no auth header.",
    )
    models_root: Path | None = Field(
        default=None, validation_alias="GRPO_MODELS_ROOT",
        description="Cache of converted bundled models; default data_dir/models.",
    )
    artifacts_root: Path | None = Field(
        default=None, validation_alias="GRPO_ARTIFACTS_ROOT",
        description="The filesystem artifact store (checkpoints, uploaded files) when GRPO_ARTIFACT_STORE is "
        "unset; default data_dir/artifacts. API and workers must see the same folder (a shared volume).",
    )
    artifact_store_url: str = Field(
        default="", validation_alias="GRPO_ARTIFACT_STORE",
        description="`s3://bucket/prefix` keeps checkpoints and uploaded files in S3-compatible object storage, "
        "so API and workers need no shared disk; empty: the folder GRPO_ARTIFACTS_ROOT.",
    )
    s3_endpoint_url: str | None = Field(
        default=None, validation_alias="GRPO_S3_ENDPOINT_URL",
        description="Endpoint of an S3-compatible service (MinIO, Ceph, R2...); default: AWS.",
    )
    s3_region: str | None = Field(default=None, validation_alias="GRPO_S3_REGION", description="S3 region.")
    s3_access_key_id: str | None = Field(
        default=None, validation_alias="GRPO_S3_ACCESS_KEY_ID",
        description="S3 credentials; unset: the AWS credential chain (AWS_* variables, profile, instance role).",
    )
    s3_secret_access_key: SecretStr | None = Field(
        default=None, validation_alias="GRPO_S3_SECRET_ACCESS_KEY", description="Secret of GRPO_S3_ACCESS_KEY_ID.",
    )
    cache_root: Path | None = Field(
        default=None, validation_alias="GRPO_CACHE_DIR",
        description="Workers' local cache of what they download from an object store (files, checkpoints); "
        "default data_dir/cache.",
    )
    artifact_retry_s: float = Field(
        default=300.0, validation_alias="GRPO_ARTIFACT_RETRY_S",
        description="How long a worker retries an unreachable artifact store (writing a checkpoint, fetching a "
        "file) before it fails the job; training waits meanwhile.",
    )
    max_file_bytes: int = Field(
        default=256 * 1024 * 1024, validation_alias="GRPO_MAX_FILE_BYTES",
        description="Largest accepted upload to POST /v1/files; bigger ones get 413.",
    )
    max_file_rows: int = Field(
        default=1_000_000, gt=0, validation_alias="GRPO_MAX_FILE_ROWS",
        description="Most rows (JSONL lines, Parquet rows) in an uploaded file; more get 413.",
    )
    max_row_bytes: int = Field(
        default=1 << 20, gt=0, validation_alias="GRPO_MAX_ROW_BYTES",
        description="Longest JSONL line, or most bytes of values in one Parquet row, of an upload; more get 413.",
    )
    max_decoded_bytes: int = Field(
        default=1 << 30, gt=0, validation_alias="GRPO_MAX_DECODED_BYTES",
        description="Most bytes an uploaded file's rows may decode to (a compressed Parquet column can expand "
        "a thousandfold); more get 413.",
    )
    max_row_group_bytes: int = Field(
        default=128 << 20, gt=0, validation_alias="GRPO_MAX_ROW_GROUP_BYTES",
        description="Most bytes one row group of an uploaded Parquet file may decompress to; more get 413.",
    )
    upload_memory_bytes: int = Field(
        default=1 << 30, ge=256 << 20, validation_alias="GRPO_UPLOAD_MEMORY_BYTES",
        description="Memory the child process that checks an upload may take; past it the upload gets 413.",
    )
    upload_check_s: float = Field(
        default=120.0, gt=0, validation_alias="GRPO_UPLOAD_CHECK_S",
        description="Longest an upload's check may run; past it the upload gets 413.",
    )
    max_uploads: int = Field(
        default=4, ge=1, validation_alias="GRPO_MAX_UPLOADS",
        description="Uploads checked at once by one API process; one more gets 429 with Retry-After.",
    )
    max_uploads_per_owner: int = Field(
        default=2, ge=1, validation_alias="GRPO_MAX_UPLOADS_PER_OWNER",
        description="Uploads of one owner checked at once by one API process; one more gets 429.",
    )
    max_body_bytes: int = Field(
        default=1_048_576, validation_alias="GRPO_MAX_BODY_BYTES",
        description="Largest accepted request body; bigger ones get 413.",
    )
    metrics_token: SecretStr | None = Field(
        default=None, validation_alias="GRPO_METRICS_TOKEN",
        description="When set, /metrics answers only `Authorization: Bearer <this token>`.",
    )
    lease_timeout_s: float = Field(
        default=120.0, validation_alias="GRPO_LEASE_TIMEOUT_S",
        description="A running job whose heartbeat is older than this may be taken over.",
    )
    heartbeat_s: float = Field(
        default=10.0, validation_alias="GRPO_HEARTBEAT_S",
        description="How often a worker renews its lease.",
    )
    sweep_s: float = Field(
        default=15.0, validation_alias="GRPO_SWEEP_S",
        description="How often each worker looks for jobs whose lease expired (their worker died, "
        "lost the store or the broker) and queues them again.",
    )
    session_idle_s: float = Field(
        default=120.0, gt=0, le=86400, validation_alias="GRPO_SESSION_IDLE_S",
        description="A tinker session run with no operation for this long saves its state and gives its worker "
        "back; its next operation queues it again.",
    )
    session_save_every_s: float = Field(
        default=60.0, ge=0, le=86400, validation_alias="GRPO_SESSION_SAVE_EVERY_S",
        description="A tinker session run saves its state at the first optim_step this long after its last save "
        "(0: at every optim_step): a killed worker loses at most this much of the run.",
    )
    sample_request_tokens: int = Field(
        default=65536, ge=1, validation_alias="GRPO_SAMPLE_REQUEST_TOKENS",
        description="The most token positions one tinker sample request may ask for: num_samples x (prompt "
        "tokens + max_tokens); past it the request is a 400 naming num_samples. It bounds one request's work; "
        "GRPO_SAMPLE_BATCH_TOKENS bounds the memory it takes.",
    )
    sample_batch_tokens: int = Field(
        default=16384, ge=1, validation_alias="GRPO_SAMPLE_BATCH_TOKENS",
        description="The most token positions a session run samples at once: rows x (longest prompt + "
        "max_tokens). Larger requests are split into batches of this size (their KV cache is what it bounds: "
        "about 46 KB a position for SmolLM2-135M in float32), and the memory is handed back after.",
    )
    requeue_queued_after_s: float = Field(
        default=600.0, validation_alias="GRPO_REQUEUE_QUEUED_AFTER_S",
        description="A job queued this long with no worker taking it is enqueued again, in case its "
        "message was lost (a broker restarted empty); a duplicate message never runs a job twice.",
    )
    max_attempts: int = Field(
        default=3, validation_alias="GRPO_MAX_ATTEMPTS",
        description="Deliveries of one job before it is failed for good.",
    )
    max_processes: int = Field(
        default=8, validation_alias="GRPO_MAX_PROCESSES",
        description="The most processes (`resources.processes`) one job may run as on a worker: "
        "one GPU each where the worker has GPUs, a share of its CPU cores otherwise.",
    )
    max_nodes: int = Field(
        default=1, ge=1, le=64, validation_alias="GRPO_MAX_NODES",
        description="The most workers (`resources.nodes`) one job may span. Above 1, the workers must each name "
        "a different node (GRPO_NODE_NAME), reach each other (GRPO_NODE_ADDRESS, GRPO_RENDEZVOUS_PORTS) and "
        "share the artifact store (a shared GRPO_DATA_DIR or GRPO_ARTIFACT_STORE).",
    )
    node_name: str = Field(
        default="", max_length=200, validation_alias="GRPO_NODE_NAME",
        description="The node (machine) this worker is, for jobs that span several: no two nodes of one job run "
        "on workers with the same name. Empty: the machine's hostname.",
    )
    node_address: str = Field(
        default="", max_length=253, validation_alias="GRPO_NODE_ADDRESS",
        description="The address the other nodes of a multi-node job reach this worker at, when it hosts the "
        "job's rendezvous (its first node). Empty: the machine's hostname.",
    )
    rendezvous_ports: str = Field(
        default="29400-29499", pattern=r"^\d{1,5}-\d{1,5}$", validation_alias="GRPO_RENDEZVOUS_PORTS",
        description="The ports (first-last) a worker hosting a multi-node job's rendezvous listens on: open "
        "them between the nodes. Single-node jobs need no inbound port.",
    )
    gang_wait_s: float = Field(
        default=300.0, gt=0, le=86400, validation_alias="GRPO_GANG_WAIT_S",
        description="How long the nodes of a multi-node job that have started wait for the others. Then they "
        "give the job back: it waits queued (an event says why), and single-node jobs keep flowing meanwhile.",
    )
    malloc: Literal["jemalloc", "glibc"] = Field(
        default="jemalloc", validation_alias="GRPO_MALLOC",
        description="The malloc training processes (workers, `grpo-jobs run`) start with: jemalloc, "
        "preloaded where the machine has it (its heap does not fragment under a step's activations), "
        "or glibc's (worker/machine/allocator.py).",
    )
    memory_budget_gb: float | None = Field(
        default=None, gt=0, validation_alias="GRPO_MEMORY_BUDGET_GB",
        description="The memory one job's step may plan on, in GB: a job whose spec leaves "
        "`model.gradient_checkpointing` unset recomputes activations only when a micro-batch's would take more "
        "than half of it. Unset: what the job's device has free when it starts (MemAvailable on a CPU).",
    )
    auto_dtype: Literal["probe", "float32", "bfloat16"] = Field(
        default="probe", validation_alias="GRPO_AUTO_DTYPE",
        description="What a spec's `model.dtype: auto` loads the base weights in on this deployment's workers: "
        "`probe`, bfloat16 where a short matmul probe (cached per machine) finds the device multiplies it at "
        "least 1.5x faster than float32, else float32; `float32` or `bfloat16`, that dtype on every device, "
        "without a probe (a fleet whose jobs must run alike). A dtype the spec names wins; FSDP trains float32.",
    )
    keep_freed_memory: bool = Field(
        default=True, validation_alias="GRPO_KEEP_FREED_MEMORY",
        description="Training on a CPU: keep freed memory in the worker for the next step instead of "
        "faulting it in again (worker/machine/allocator.py; under jemalloc, `MALLOC_CONF` unless set); handed back "
        "when the job ends.",
    )

    vllm_python: Path | None = Field(
        default=None, validation_alias="GRPO_VLLM_PYTHON",
        description="The Python of the environment vLLM is installed in (`make vllm` builds `.venv-vllm`): jobs "
        "with `rollout.engine: vllm` start their server with it. Unset: such jobs fail with a readable event.",
    )
    vllm_args: str = Field(
        default="", validation_alias="GRPO_VLLM_ARGS",
        description="Extra command-line arguments for every job's vLLM server, e.g. '--gpu-memory-utilization 0.4'. "
        "On a CPU worker '--enforce-eager' is added (no compile at start-up) unless given.",
    )
    vllm_start_timeout_s: float = Field(
        default=600.0, validation_alias="GRPO_VLLM_START_TIMEOUT_S",
        description="How long a job waits for its vLLM server to be ready before it fails.",
    )

    @property
    def node(self) -> str:
        """This worker's node name (GRPO_NODE_NAME, else the hostname)."""
        return self.node_name or socket.gethostname()

    @property
    def rendezvous_address(self) -> str:
        """Where the other nodes reach this worker (GRPO_NODE_ADDRESS, else the hostname)."""
        return self.node_address or socket.gethostname()

    @property
    def rendezvous_port_range(self) -> range:
        first, last = (int(p) for p in self.rendezvous_ports.split("-"))
        return range(first, last + 1)

    @property
    def store_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'grpo-jobs.db'}"

    @property
    def broker(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{self.data_dir / 'broker.db'}"

    @property
    def datasets_dir(self) -> Path:
        return self.datasets_root or self.data_dir / "datasets"

    @property
    def model_roots(self) -> list[Path]:
        return [Path(p) for p in self.model_roots_env.split(":") if p.strip()]

    @field_validator("reward_urls_env")
    @classmethod
    def _reward_urls(cls, v: str) -> str:
        parse_allow_list(_split(v))  # a bad entry stops the service at start-up, naming it
        return v

    @property
    def reward_urls(self) -> list[GraderUrl]:
        return parse_allow_list(_split(self.reward_urls_env))

    @field_validator("environment_urls_env")
    @classmethod
    def _environment_urls(cls, v: str) -> str:
        parse_allow_list(_split(v), "GRPO_ENVIRONMENT_URLS")
        return v

    @property
    def environment_urls(self) -> list[GraderUrl]:
        return parse_allow_list(_split(self.environment_urls_env), "GRPO_ENVIRONMENT_URLS")

    @field_validator("webhook_urls_env")
    @classmethod
    def _webhook_urls(cls, v: str) -> str:
        parse_allow_list(_split(v), "GRPO_WEBHOOK_URLS")
        return v

    @property
    def admin_owners(self) -> frozenset[str]:
        return frozenset(_split(self.admin_owners_env))

    @property
    def webhook_urls(self) -> list[GraderUrl]:
        return parse_allow_list(_split(self.webhook_urls_env), "GRPO_WEBHOOK_URLS")

    @property
    def upload_budget(self) -> Budget:
        return Budget(max_rows=self.max_file_rows, max_row_bytes=self.max_row_bytes,
                      max_decoded_bytes=self.max_decoded_bytes, max_row_group_bytes=self.max_row_group_bytes)

    @property
    def models_dir(self) -> Path:
        return self.models_root or self.data_dir / "models"

    @property
    def artifacts_dir(self) -> Path:
        return self.artifacts_root or self.data_dir / "artifacts"

    @property
    def cache_dir(self) -> Path:
        return self.cache_root or self.data_dir / "cache"

    @property
    def precision_cache(self) -> Path:
        """The machine's bfloat16/float32 probe, shared by every job so they all choose alike."""
        return self.cache_dir / "precision.json"


@lru_cache
def get_settings() -> Settings:
    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings


def settings_table() -> str:
    """Every setting as a Markdown table (variable, default, what it does), from the fields' own
    descriptions: `grpo-jobs settings` prints it and docs/operations/settings.md is its output."""

    def default(field: FieldInfo) -> str:
        value = field.default
        if value is None or value == "":
            return "unset"
        if isinstance(value, Path) and value.is_relative_to(Path.home()):
            return f"`~/{value.relative_to(Path.home())}`"
        return f"`{value}`"

    rows = [f"| `{f.validation_alias}` | {default(f)} | {(f.description or '').replace('|', '&#124;')} |"
            for f in Settings.model_fields.values()]
    return "\n".join(["| variable | default | |", "| --- | --- | --- |", *rows])
