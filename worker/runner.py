"""A job's lifecycle: lease, status transitions, resume, and a readable error when it fails.

queued -> running -> succeeded | failed | cancelled. The lease is a conditional UPDATE in SQL,
so a redelivered message can never run one job twice; a redelivery after a crash (stale
heartbeat) takes the job over and resumes from its last checkpoint; after `max_attempts`
deliveries it gives up with a clear error.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
import uuid
from typing import Literal

from pydantic import TypeAdapter

from service.settings import Settings
from service.specs import TERMINAL, JobSpec
from service.store import events as events_q
from service.store import jobs as jobs_q
from service.store.db import session_scope
from worker import allocator
from worker.sql_reporter import SqlReporter

log = logging.getLogger(__name__)
Outcome = Literal["succeeded", "failed", "cancelled", "skipped", "busy", "missing"]
_SPEC = TypeAdapter(JobSpec)


def loop_for(kind: str):
    """The training loop of a job kind (imported lazily: each pulls in torch and transformers)."""
    if kind == "grpo":
        from worker.loops import grpo
        return grpo.run
    if kind == "tracin":
        from worker.loops import tracin
        return tracin.run
    if kind == "joint":
        from worker.loops import joint
        return joint.run
    raise ValueError(f"unknown job kind {kind!r}")


def _fail(url: str, job_id: int, holder: str | None, message: str, data: dict | None = None) -> None:
    with session_scope(url) as s:
        events_q.add_event(s, job_id=job_id, type="failed", level="error", message=message, data=data)
    with session_scope(url) as s:
        jobs_q.finish_job(s, job_id=job_id, holder=holder, status="failed", error=message)


def run_job(job_id: int, *, settings: Settings, holder: str | None = None) -> Outcome:
    holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    url = settings.store_url
    with session_scope(url) as s:
        job = jobs_q.get_job(s, job_id=job_id)
        if job is None:
            log.warning("job %s does not exist; dropping the message", job_id)
            return "missing"
        if job.status in TERMINAL:
            return "skipped"
    with session_scope(url) as s:
        if not jobs_q.acquire_lease(s, job_id=job_id, holder=holder, lease_timeout_s=settings.lease_timeout_s):
            return "busy"  # another worker holds a live lease
    with session_scope(url) as s:
        job = jobs_q.get_job(s, job_id=job_id)
        attempt, spec_json = job.attempt, job.spec
    if attempt > settings.max_attempts:
        _fail(url, job_id, holder, f"gave up after {settings.max_attempts} attempts: the worker running it "
              "stopped without finishing each time (out of memory, killed, or lost)")
        return "failed"

    reporter = SqlReporter(job_id, holder=holder, settings=settings)
    reporter.event("started", f"attempt {attempt} on {holder}", data={"attempt": attempt, "holder": holder})
    try:
        spec = _SPEC.validate_python(spec_json)
    except Exception as exc:
        _fail(url, job_id, holder, f"stored spec is no longer valid: {exc}")
        return "failed"
    reporter.start()
    try:
        result = loop_for(spec.kind)(spec, reporter, settings=settings)
    except Exception as exc:
        tb = traceback.format_exc(limit=8)
        log.exception("job %s failed", job_id)
        _fail(url, job_id, holder, f"{type(exc).__name__}: {exc}", data={"traceback": tb})
        return "failed"
    finally:
        reporter.stop()
        allocator.release_freed_memory()  # where the process outlives the job (tests, embedded runs)
    if reporter.lease_lost:
        log.warning("job %s: lease lost to another worker; not recording an outcome", job_id)
        return "skipped"
    status = result.get("status", "succeeded")
    with session_scope(url) as s:
        events_q.add_event(s, job_id=job_id, type=status, message=f"job {status} at step {result.get('step')}",
                           data={k: v for k, v in result.items() if k != "status"})
    with session_scope(url) as s:
        jobs_q.finish_job(s, job_id=job_id, holder=holder, status=status)
    return status
