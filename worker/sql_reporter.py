"""The runner's Reporter: every call lands in the SQL store; a thread renews the lease."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from service.settings import Settings
from service.store import events as events_q
from service.store import jobs as jobs_q
from service.store import metrics as metrics_q
from service.store import records
from service.store.db import session_scope
from worker.reporting import Reporter, _clean

log = logging.getLogger(__name__)


class SqlReporter(Reporter):
    def __init__(self, job_id: int, *, holder: str, settings: Settings) -> None:
        self.job_id, self.holder, self.url = job_id, holder, settings.store_url
        self.checkpoint_root = settings.artifacts_dir / f"job-{job_id}" / "checkpoints"
        self.heartbeat_s = settings.heartbeat_s
        self._cancel = threading.Event()
        self._lost = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{job_id}", daemon=True)

    # -- lease -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        while not self._done.wait(self.heartbeat_s):
            self._renew()

    def _renew(self, step: int | None = None) -> None:
        try:
            with session_scope(self.url) as s:
                cancel = jobs_q.heartbeat(s, job_id=self.job_id, holder=self.holder, step=step)
        except Exception:  # a store hiccup must not kill training; the next beat retries
            log.exception("heartbeat failed for job %s", self.job_id)
            return
        if cancel is None:
            self._lost.set()
        elif cancel:
            self._cancel.set()

    @property
    def lease_lost(self) -> bool:
        return self._lost.is_set()

    # -- Reporter ----------------------------------------------------------------------------
    def should_stop(self) -> bool:
        return self._cancel.is_set() or self._lost.is_set()

    def progress(self, step: int) -> None:
        self._renew(step)

    def event(self, type, message="", *, level="info", data=None):
        with session_scope(self.url) as s:
            events_q.add_event(s, job_id=self.job_id, type=type, message=message, level=level, data=_clean(data))

    def metrics(self, step, values):
        with session_scope(self.url) as s:
            metrics_q.upsert_step(s, job_id=self.job_id, step=step, values=values)

    def samples(self, step, rows):
        with session_scope(self.url) as s:
            records.put_samples(s, job_id=self.job_id, step=step, rows=_clean(rows))

    def selection(self, record):
        with session_scope(self.url) as s:
            records.put_selection(s, job_id=self.job_id, record=_clean(record))

    def sparsity(self, record):
        with session_scope(self.url) as s:
            records.put_sparsity(s, job_id=self.job_id, record=_clean(record))

    def checkpoint(self, step, path: Path, format, size_bytes):
        with session_scope(self.url) as s:
            records.put_checkpoint(s, job_id=self.job_id, step=step, path=str(path), format=format,
                                   size_bytes=size_bytes)
