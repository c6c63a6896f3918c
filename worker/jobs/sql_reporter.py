"""The runner's Reporter: every call lands in the SQL store; a thread renews the lease.

The store may go away for a while (a failover, a network blip). Every write is retried with
backoff for as long as the lease could still be ours; the heartbeat thread declares the lease
lost once it has gone unrenewed for nearly the lease timeout (another worker may take the job
over then). From that moment every call raises `LeaseLost`: the loop stops at once, writes no
checkpoint, and the runner records nothing; the sweep of a live worker requeues the job and
it resumes from its last checkpoint.

Checkpoints and uploaded files go through the artifact store (service/core/artifacts.py): staged and
cached under GRPO_CACHE_DIR on this machine, uploaded or fetched, and retried with backoff for
GRPO_ARTIFACT_RETRY_S while the store is unreachable.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy.orm import Session

from service.core.artifacts import (
    COMPLETE,
    ArtifactStoreError,
    checkpoint_key,
    checkpoints_prefix,
    newest_step,
    open_store,
    sha256_of,
)
from service.core.records import OpResult, PendingOp
from service.core.settings import Settings
from service.core.sources import unavailable_checkpoint
from service.store import events as events_q
from service.store import files as files_q
from service.store import leases, records, session_ops
from service.store import metrics as metrics_q
from service.store.db import is_unreachable, session_scope
from worker.reporting import InitWeights, LeaseLost, Operations, Reporter, _clean

log = logging.getLogger(__name__)
T = TypeVar("T")


class SqlReporter(Reporter):
    def __init__(self, job_id: int, *, uid: str, owner: str, holder: str, settings: Settings) -> None:
        self.job_id, self.owner, self.holder, self.url = job_id, owner, holder, settings.store_url
        self.settings, self.uid = settings, uid
        # A job's artifacts live under its globally unique id, never its store-local number.
        self.store = open_store(settings)
        self.checkpoint_root = self._local(checkpoints_prefix(uid))
        self.heartbeat_s = settings.heartbeat_s
        # Give up the lease a beat before it expires, so two workers never both think they hold it.
        self.give_up_after_s = max(settings.lease_timeout_s - settings.heartbeat_s, settings.lease_timeout_s / 2)
        self._renewed_at = time.monotonic()
        self._cancel = threading.Event()
        self._lost = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{job_id}", daemon=True)

    # -- lease -------------------------------------------------------------------------------
    def start(self) -> None:
        self._renewed_at = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        while not self._done.wait(self.heartbeat_s):
            self._renew()

    def _renew(self) -> None:
        try:
            self._heard(leases.heartbeat(self.url, job_id=self.job_id, holder=self.holder))
        except Exception as exc:  # a store hiccup must not kill training while the lease holds
            log.warning("job %s: could not renew the lease (%s)", self.job_id, type(exc).__name__)
            self._give_up_if_stale()

    def _heard(self, cancel: bool | None) -> None:
        """What a heartbeat answered: None when the lease is no longer ours, else cancel_requested."""
        if cancel is None:
            self._lost.set()
            return
        self._renewed_at = time.monotonic()
        if cancel:
            self._cancel.set()

    def _give_up_if_stale(self) -> None:
        unrenewed = time.monotonic() - self._renewed_at
        if unrenewed > self.give_up_after_s and not self._lost.is_set():
            log.error("job %s: lease unrenewed for %.0f s; stopping and leaving the job to the sweep",
                      self.job_id, unrenewed)
            self._lost.set()

    def _check_lease(self) -> None:
        if self._lost.is_set():
            raise LeaseLost(f"job {self.job_id}: lease lost")

    def _write(self, fn: Callable[[Session], T]) -> T:
        """Run `fn` in one transaction, retrying while the store is unreachable and the lease holds."""

        def once() -> T:
            with session_scope(self.url) as s:
                return fn(s)

        return self._retrying(once)

    def _retrying(self, fn: Callable[[], T]) -> T:
        """`fn()` (a store call that is its own transaction), retried while the store is unreachable
        and the lease holds."""
        delay = 0.25
        while True:
            self._check_lease()
            try:
                return fn()
            except Exception as exc:
                if not is_unreachable(exc):
                    raise
                log.warning("job %s: store unreachable (%s); retrying in %.1f s", self.job_id,
                            type(exc).__name__, delay)
                self._give_up_if_stale()
                time.sleep(delay)
                delay = min(delay * 2, max(self.heartbeat_s, 1.0))

    # -- Reporter ----------------------------------------------------------------------------
    def should_stop(self) -> bool:
        self._check_lease()
        return self._cancel.is_set()

    def progress(self, step: int) -> None:
        self._heard(self._retrying(lambda: leases.heartbeat(self.url, job_id=self.job_id, holder=self.holder, step=step)))
        self._check_lease()

    def event(self, type, message="", *, level="info", data=None):
        self._write(lambda s: events_q.add_event(s, job_id=self.job_id, type=type, message=message, level=level,
                                                 data=_clean(data)))

    def metrics(self, step, values):
        self._write(lambda s: metrics_q.upsert_step(s, job_id=self.job_id, step=step, values=values))

    def samples(self, step, rows):
        self._write(lambda s: records.put_samples(s, job_id=self.job_id, step=step, rows=_clean(rows)))

    def selection(self, record):
        self._write(lambda s: records.put_selection(s, job_id=self.job_id, record=_clean(record)))

    def sparsity(self, record):
        self._write(lambda s: records.put_sparsity(s, job_id=self.job_id, record=_clean(record)))

    # -- checkpoints and files, through the artifact store --------------------------------------
    def _stored(self, fn: Callable[[], T]) -> T:
        """Run an artifact-store call, retrying with backoff while the store is unreachable, for up
        to GRPO_ARTIFACT_RETRY_S (a warning event says so once); then its ArtifactStoreError fails the job."""
        delay, t0, warned = 1.0, time.monotonic(), False
        while True:
            self._check_lease()
            try:
                return fn()
            except ArtifactStoreError as exc:
                if time.monotonic() - t0 > self.settings.artifact_retry_s:
                    raise
                if not warned:
                    warned = True
                    self.event("warning", f"{exc}; retrying for up to {self.settings.artifact_retry_s:.0f} s",
                               level="warning")
                log.warning("job %s: %s; retrying in %.0f s", self.job_id, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _local(self, key: str) -> Path:
        """Where `key` is on this machine: in the folder store itself, or in the worker's cache."""
        return self.store.local_path(key) or self.settings.cache_dir / key

    def _fetch(self, key: str) -> Path:
        """A complete checkpoint folder on this machine (downloaded unless it already is)."""
        local = self._local(key)
        if not (local / COMPLETE).exists():
            if self.store.local:
                raise FileNotFoundError(key)
            self._stored(lambda: self.store.get_dir(key, local))
        return local

    def checkpoint(self, step, path: Path, format, size_bytes):
        key = checkpoint_key(self.uid, step)
        if not self.store.local:  # the folder store was written in place
            self._stored(lambda: self.store.put_dir(key, path))
            shutil.rmtree(path)  # staged only: a resume downloads what it needs
        self._write(lambda s: records.put_checkpoint(s, job_id=self.job_id, step=step, path=key,
                                                     format=format, size_bytes=size_bytes))

    def resume_from(self) -> Path | None:
        step = newest_step(self._stored(lambda: self.store.list(checkpoints_prefix(self.uid))))
        return None if step is None else self._fetch(checkpoint_key(self.uid, step))

    def init_checkpoint(self, job: int, step: int | None) -> InitWeights:
        found = self._write(lambda s: records.owned_checkpoint(s, owner=self.owner, job_id=job, step=step))
        try:
            if found is not None:
                step = found.checkpoint.step
                return InitWeights(self._fetch(checkpoint_key(found.job.uid, step)), job, step)
        except FileNotFoundError:
            pass
        raise ValueError(unavailable_checkpoint(job, step))  # checked at submit; gone since (deleted, files lost)

    def data_file(self, file_id: str) -> Path:
        found = self._write(lambda s: files_q.get_file(s, file_id=file_id, owner=self.owner))
        if found is None:  # checked at submit; deleted since
            raise FileNotFoundError(f"file {file_id} is no longer there: it was deleted after the job was submitted")
        local = self._local(found.key)
        if self.store.local:
            if not local.is_file():
                raise FileNotFoundError(f"file {file_id}'s content is gone from the artifact store")
            return local
        if not (local.is_file() and local.stat().st_size == found.bytes):  # the cache keeps what was fetched
            try:
                self._stored(lambda: self.store.get_file(found.key, local))
            except FileNotFoundError:
                raise FileNotFoundError(f"file {file_id}'s content is gone from the artifact store") from None
            if sha256_of(local) != found.sha256:
                local.unlink()
                raise ValueError(f"file {file_id}: the artifact store returned other bytes than were uploaded")
        return local

    def operations(self) -> Operations:
        return StoreOperations(self.url, self.job_id)

    def finish(self, status: str, message: str, *, error: str | None = None, data: dict | None = None) -> None:
        """The job's outcome and its final event, in one transaction, while the lease is ours
        (LeaseLost if it is not: another worker took the job over, and it records the outcome)."""
        if not self._retrying(lambda: leases.finish_job(self.url, job_id=self.job_id, holder=self.holder, status=status,
                                                        message=message, error=error, data=_clean(data))):
            self._lost.set()
            raise LeaseLost(f"job {self.job_id}: lease lost before its outcome was recorded")


class StoreOperations:
    """A session run's operations in the store (service.store.session_ops)."""

    def __init__(self, url: str, job_id: int) -> None:
        self.url, self.job_id = url, job_id

    def next(self) -> PendingOp | None:
        return session_ops.next_op(self.url, job_id=self.job_id)

    def next_run(self, kind: str, limit: int) -> list[PendingOp]:
        return session_ops.next_run(self.url, job_id=self.job_id, kind=kind, limit=limit)

    def complete(self, results: list[OpResult]) -> None:
        session_ops.complete_ops(self.url, results=results)

    def fail(self, op: PendingOp, error: str, category: str) -> None:
        session_ops.fail_op(self.url, op_id=op.id, error=error, category=category)

    def fail_pending(self, error: str, category: str) -> None:
        session_ops.fail_pending(self.url, job_id=self.job_id, error=error, category=category)

    def name_checkpoint(self, kind: str, name: str, step: int) -> None:
        session_ops.name_checkpoint(self.url, job_id=self.job_id, kind=kind, name=name, step=step)
