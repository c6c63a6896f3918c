"""The job's port: what a loop writes, what it reads, and whether it must stop, as separate protocols.

- `Records`: what a loop writes (events, metrics, samples, selections, sparsity, checkpoints, progress);
- `Inputs`: what it reads from where it runs (the resume point, an earlier job's weights, an uploaded file);
- `StopSignal`: whether to stop now (a cancel, a lost lease);
- `SessionQueue`: the operations a tinker session run executes (worker/session/).

`Reporter` provides all four: the runner passes its SQL implementation (worker/jobs/sql_reporter.py),
`grpo-jobs run` the file one (`FileReporter`), and a job on several processes wraps either in
`RankReporter`. A part of a loop takes the narrowest protocol it needs, so it never knows which one it has.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel

from service.core.records import OpResult, PendingOp, SampleRow, SelectionRecord, SparsityRecord


@dataclass(frozen=True)
class LoopResult:
    """What a loop returns to the runner: how it ended, at which step, and its last evaluation."""

    status: Literal["succeeded", "cancelled", "idle"]  # idle: a session run handing its worker back
    step: int  # the last step whose update was made
    eval: dict[str, float] = field(default_factory=dict)
    why: str = ""  # idle: why the run hands its worker back


class LeaseLost(Exception):
    """This worker no longer holds the job's lease: stop without recording anything (raised by a
    reporter that holds one, worker/jobs/sql_reporter.py; a loop lets it through)."""


class Operations(Protocol):
    """A session run's queue of operations (the futures its tinker client polls)."""

    def next(self) -> PendingOp | None: ...

    def next_run(self, kind: str, limit: int) -> list[PendingOp]:
        """The next pending operations while they are of `kind`, in order (at most `limit`)."""

    def complete(self, results: list[OpResult]) -> None:
        """Operations' results for their futures, with the samples they drew: all recorded together."""

    def fail(self, op: PendingOp, error: str, category: str) -> None: ...

    def fail_pending(self, error: str, category: str) -> None: ...

    def name_checkpoint(self, kind: str, name: str, step: int) -> None: ...


@dataclass(frozen=True)
class InitWeights:
    """A checkpoint that `model.init_from` named, on this machine."""

    path: Path  # its folder
    job: int
    step: int
    source: str = ""  # where it came from when not a job of the service's (`grpo-jobs run --init-from DIR`)


class Records(Protocol):
    """What a loop writes."""

    def event(self, type: str, message: str = "", *, level: str = "info", data: dict[str, Any] | None = None) -> None:
        """A line of the job's log (`level` debug, info, warning or error) with optional structured data."""

    def metrics(self, step: int, values: dict[str, float]) -> None:
        """Step `step`'s metrics, by key."""

    def samples(self, step: int, rows: list[SampleRow]) -> None: ...

    def selection(self, record: SelectionRecord) -> None: ...

    def sparsity(self, record: SparsityRecord) -> None: ...

    def checkpoint_dir(self, step: int) -> Path:
        """Where the loop writes checkpoint `step` before handing it to `checkpoint`."""
        ...

    def checkpoint(self, step: int, path: Path, format: str, size_bytes: int) -> None:
        """Checkpoint `step` is complete in folder `path`: keep it."""

    def progress(self, step: int) -> None:
        """Step `step`'s update is made (the job's progress and heartbeat)."""


class Inputs(Protocol):
    """What a loop reads from where it runs."""

    def resume_from(self) -> Path | None:
        """The folder of this job's newest complete checkpoint, if an earlier attempt left one."""
        ...

    def init_checkpoint(self, job: int, step: int | None) -> InitWeights:
        """Checkpoint `step` (None: the latest) of the owner's earlier job `job` (model.init_from)."""
        ...

    def data_file(self, file_id: str) -> Path:
        """An uploaded file of the owner's (dataset.name 'file'), on this machine."""
        ...


class StopSignal(Protocol):
    """Whether the loop must stop at its next step boundary."""

    def should_stop(self) -> bool: ...


class SessionQueue(Protocol):
    """Where a session run's operations come from."""

    def operations(self) -> Operations: ...


def _clean(x: Any) -> Any:
    """JSON-safe: NaN/inf become None (strict JSON has no NaN); records keep their type."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, BaseModel):
        return type(x).model_validate(_clean(x.model_dump()))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _clean(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _json_model(x: Any) -> Any:
    if isinstance(x, BaseModel):
        return x.model_dump(mode="json")
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


class Reporter:
    """The job's port, all of it (Records, Inputs, StopSignal, SessionQueue). This base records nothing and
    never asks to stop; its subclasses override what they keep."""

    #: directory for checkpoints of this run
    checkpoint_root: Path
    #: the job's id in the service's store (None outside it); remote graders are told it
    job_id: int | None = None
    #: which attempt at the job this is (1 but after a worker running it stopped without an outcome)
    attempt: int = 1

    def event(self, type: str, message: str = "", *, level: str = "info", data: dict | None = None) -> None: ...

    def metrics(self, step: int, values: dict[str, float]) -> None: ...

    def samples(self, step: int, rows: list[SampleRow]) -> None: ...

    def selection(self, record: SelectionRecord) -> None: ...

    def sparsity(self, record: SparsityRecord) -> None: ...

    def checkpoint_dir(self, step: int) -> Path:
        """Where the loop writes checkpoint `step` before handing it to `checkpoint`."""
        return self.checkpoint_root / f"step-{step}"

    def checkpoint(self, step: int, path: Path, format: str, size_bytes: int) -> None:
        """Checkpoint `step` is complete in folder `path`: keep it (the SQL reporter uploads it)."""

    def resume_from(self) -> Path | None:
        """The folder of this job's newest complete checkpoint, if an earlier attempt left one."""
        from worker.model.checkpoints import latest_checkpoint

        return latest_checkpoint(self.checkpoint_root)

    def progress(self, step: int) -> None: ...

    def init_checkpoint(self, job: int, step: int | None) -> InitWeights:
        """Checkpoint `step` (None: the latest) of the owner's earlier job `job` (model.init_from)."""
        raise ValueError("model.init_from names a job of the service's store: submit the spec to the service")

    def data_file(self, file_id: str) -> Path:
        """An uploaded file of the owner's (dataset.name 'file'), on this machine."""
        raise ValueError("dataset.name 'file' names files uploaded to the service: submit the spec to the service")

    def should_stop(self) -> bool:
        return False

    def operations(self) -> Operations:
        """The operations of the session run this reporter records (kind `session`)."""
        raise ValueError("a session run is driven through the service's tinker API (/api/v1), not run from a spec")


class FileReporter(Reporter):
    """`grpo-jobs run --out DIR`: metrics.jsonl, events.jsonl, selections.jsonl, sparsity.jsonl,
    samples.jsonl and checkpoints/step-N/."""

    def __init__(self, out: Path, *, echo=None, init_from: Path | None = None) -> None:
        self.out = Path(out)
        self.init_from = init_from  # an earlier run's folder, where model.init_from's checkpoints are
        self.out.mkdir(parents=True, exist_ok=True)
        self.checkpoint_root = self.out / "checkpoints"
        self.echo = echo

    def _append(self, name: str, obj: dict) -> None:
        with (self.out / name).open("a") as f:
            f.write(json.dumps(_clean(obj), default=_json_model) + "\n")

    def event(self, type, message="", *, level="info", data=None):
        self._append("events.jsonl", {"time": time.time(), "type": type, "level": level, "message": message, "data": data})
        if self.echo:
            self.echo(f"[{level}] {type}: {message}")

    def metrics(self, step, values):
        self._append("metrics.jsonl", {"step": step, "metrics": values})
        if self.echo:
            shown = ("reward/mean", "loss/total", "kl", "eval/accuracy", "eval/reward_mean", "env/turns_mean", "time/step_s")
            self.echo(f"step {step}: " + ", ".join(f"{k}={values[k]:.4g}" for k in shown if values.get(k) is not None))

    def samples(self, step, rows):
        for r in rows:
            self._append("samples.jsonl", {"step": step, **dataclasses.asdict(r)})

    def selection(self, record):
        self._append("selections.jsonl", dataclasses.asdict(record))

    def sparsity(self, record):
        self._append("sparsity.jsonl", dataclasses.asdict(record))

    def init_checkpoint(self, job, step):
        if self.init_from is None:
            return super().init_checkpoint(job, step)
        from service.core.artifacts import COMPLETE
        from worker.model.checkpoints import latest_checkpoint

        root = self.init_from / "checkpoints"
        folder = latest_checkpoint(root) if step is None else root / f"step-{step}"
        if folder is None or not (folder / COMPLETE).exists():
            raise ValueError(f"{self.init_from} has no complete checkpoint" + ("" if step is None else f" at step {step}"))
        return InitWeights(folder, job, int(folder.name.removeprefix("step-")), source=str(self.init_from))

    def checkpoint(self, step, path, format, size_bytes):
        self._append("checkpoints.jsonl", {"step": step, "path": str(path), "format": format, "size_bytes": size_bytes})


class RankReporter(Reporter):
    """One rank's view of a job's reporter when the job spans several processes: rank 0 records
    through the real one, the other ranks record nothing, and what every rank needs to know
    (stop now? resume from where? which files?) is asked by rank 0 and broadcast, so all ranks
    act on the same answer at the same point of the loop."""

    def __init__(self, inner: Reporter | None, ranks) -> None:
        self.inner, self.ranks = (inner if ranks.main else Reporter()), ranks
        self.job_id = getattr(inner, "job_id", None)
        self.checkpoint_root = getattr(inner, "checkpoint_root", None)

    def _main(self, name: str, *args) -> None:
        if self.ranks.main:
            getattr(self.inner, name)(*args)

    def _shared(self, name: str, *args):
        """Rank 0's answer (or its exception) on every rank."""
        answer = error = None
        if self.ranks.main:
            try:
                answer = getattr(self.inner, name)(*args)
            except Exception as exc:  # every rank raises it, so none waits for the others
                error = exc
        answer, error = self.ranks.broadcast((answer, error))
        if error is not None:
            raise error
        return answer

    def event(self, type, message="", *, level="info", data=None):
        if self.ranks.main:
            self.inner.event(type, message, level=level, data=data)

    def metrics(self, step, values):
        self._main("metrics", step, values)

    def samples(self, step, rows):
        self._main("samples", step, rows)

    def selection(self, record):
        self._main("selection", record)

    def sparsity(self, record):
        self._main("sparsity", record)

    def checkpoint_dir(self, step):
        return self.inner.checkpoint_dir(step) if self.ranks.main else None

    def checkpoint(self, step, path, format, size_bytes):
        self._main("checkpoint", step, path, format, size_bytes)

    def progress(self, step):
        self._main("progress", step)

    def should_stop(self) -> bool:
        return self._shared("should_stop")

    def resume_from(self):
        return self._shared("resume_from")

    def init_checkpoint(self, job, step):
        return self._shared("init_checkpoint", job, step)

    def data_file(self, file_id):
        return self._shared("data_file", file_id)
