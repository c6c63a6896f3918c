"""The sweep: while a worker runs, it periodically takes back jobs nobody is running.

A job whose worker was killed, lost the broker or lost the store stops renewing its lease.
Every worker's main process runs this sweep every `GRPO_SWEEP_S`: expired leases go back to
`queued` and are enqueued again (or `cancelled`, when a cancel was asked for), and queued jobs
whose message may have been lost are enqueued again. It is safe on every worker at once: each
job is claimed by a conditional UPDATE (service.store.jobs.sweep), and the lease lets only one
delivery run a job. It does not depend on the broker redelivering an unacked message.
"""

from __future__ import annotations

import logging

from service.core import queue
from service.core.records import WorkerInfo
from service.core.settings import Settings
from service.store import leases, session_ops
from service.store import workers as workers_q
from service.store.db import session_scope
from service.store.periodic import Periodic

log = logging.getLogger(__name__)


def sweep_once(settings: Settings) -> leases.Swept:
    swept = leases.sweep(settings.store_url, lease_timeout_s=settings.lease_timeout_s,
                         requeue_queued_after_s=settings.requeue_queued_after_s)
    unsent = []
    for job in swept.requeue:
        try:
            queue.enqueue(job, broker_url=settings.broker)
        except Exception as exc:  # the broker is down: a session run goes back to idle, woken at the next sweep
            with session_scope(settings.store_url) as session:
                session_ops.unwake(session, job_id=job.job_id, why=f"the broker was unreachable ({type(exc).__name__})")
            unsent.append(job.job_id)
    if unsent:
        log.warning("sweep: the broker is unreachable; jobs %s wait for the next sweep", unsent)
    if swept.requeue or swept.cancelled:
        log.warning("sweep: requeued jobs %s, cancelled stranded jobs %s",
                    [j.job_id for j in swept.requeue], swept.cancelled)
    return swept


def sweeper(settings: Settings, me: WorkerInfo | None = None) -> Periodic:
    """The sweep every `settings.sweep_s`, in a thread of the worker's main process, after `me` says it is
    alive in the worker registry. One thread for both: the main process forks each job's process, and a
    round's store connections are dropped when it ends (Periodic), which a second thread's round in flight
    would not survive (two threads on one PostgreSQL session: 'prepared statement "_pg3_0" already exists')."""
    def one_round() -> None:
        if me is not None:
            workers_q.beat(settings.store_url, info=me)
        sweep_once(settings)

    return Periodic("lease-sweeper", one_round, settings.sweep_s)
