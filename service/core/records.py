"""The records a training loop hands to the store besides metrics: a TracIn selection, a sparsity
measurement, a recorded completion. Plain dataclasses: the loops build them, the store keeps them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.core.sparsity import SparsityReport


@dataclass(frozen=True)
class SelectionRecord:
    """One TracIn step's selection: which samples were kept, and the influence behind it."""

    step: int
    policy: str  # tracin.selection
    total: int  # samples scored
    selected: int
    ratio: float  # selected / total
    mean_influence: float
    min_influence: float
    max_influence: float
    histogram: dict[str, list[float]]  # {"edges": [...], "counts": [...]}
    scores: list[tuple[int, float, bool]]  # (sample index, influence, selected)


@dataclass(frozen=True)
class SparsityRecord:
    """One sparsity measurement over optimizer steps from_step..step."""

    step: int
    from_step: int
    scope: str  # "window" (since the last measurement) or "cumulative" (since the start)
    sparsity: float  # share of unchanged parameters at the primary threshold
    report: SparsityReport  # the whole measurement (worker/sparsity_tracker.py)


@dataclass(frozen=True)
class SampleRow:
    """One recorded completion of a step."""

    index: int  # row in the step's rollout batch
    prompt: str
    completion: str
    reward: float | None  # None: the client grades it (a session run's samples)
    advantage: float | None
    influence: float | None = None  # TracIn only
    selected: bool | None = None  # TracIn only
    extra: dict[str, Any] | None = None  # joint: the document it answered from


@dataclass(frozen=True)
class Samples:
    """Completions a session run drew at `step`, recorded after those it drew before at that step."""

    step: int
    rows: list[SampleRow]


@dataclass(frozen=True)
class PendingOp:
    """An operation a tinker client sent to a session run, for its worker to run (service.store.session_ops)."""

    id: int
    request_id: str
    kind: str  # forward_backward | optim_step | sample | ...
    body: bytes  # the request as sent


@dataclass(frozen=True)
class OpResult:
    """An operation's result for its future, with the samples it drew."""

    op: PendingOp
    result: bytes
    result_format: str  # json | proto
    samples: Samples | None = None


@dataclass(frozen=True)
class OpState:
    """A stored operation as its future reads it."""

    kind: str
    status: str  # pending | done | failed
    result: bytes | None  # done: the result, in result_format
    result_format: str | None  # json | proto
    error: str | None  # failed: why
    category: str | None  # failed: user | server


@dataclass(frozen=True)
class GpuInfo:
    """A GPU a worker has, as torch sees it under the worker's CUDA_VISIBLE_DEVICES."""

    index: int  # its cuda:N in the worker's jobs
    name: str  # e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: int  # total


# Event data that names the cluster (a worker process, a machine, a server's address or a file on it): kept
# in the store, shown only to the admin's keys (GRPO_ADMIN_OWNERS). Messages never carry them.
CLUSTER_KEYS = frozenset({"holder", "node_name", "hostname", "server_url", "log"})


def without_cluster(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """Event data as a tenant sees it: without what names the cluster."""
    return None if data is None else {k: v for k, v in data.items() if k not in CLUSTER_KEYS}


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker says of itself in the registry (service/store/workers.py)."""

    name: str  # hostname:pid:random, unique per worker process
    hostname: str
    gpus: list[GpuInfo]
    queues: list[str]  # service/core/queue.py: `jobs`, and `gpu`..`gpuN` on a worker with N GPUs
    concurrency: int  # jobs it runs at once
