"""The Celery application of the workers (settings only; the task is in worker.tasks)."""

import logging

from celery import Celery
from celery.signals import worker_ready

from service import queue
from service.settings import get_settings

app = Celery("grpo_jobs", include=["worker.tasks"])
app.conf.update(queue.celery_config(get_settings().broker))
log = logging.getLogger(__name__)


@worker_ready.connect
def requeue_orphans(**_kwargs) -> None:
    """A worker killed mid-job may take its message with it (kombu's SQL transport keeps unacked
    messages in memory); on start, re-enqueue jobs that look abandoned."""
    from service.store import jobs as jobs_q
    from service.store.db import session_scope

    settings = get_settings()
    try:
        with session_scope(settings.store_url) as s:
            ids = jobs_q.orphaned_job_ids(s, lease_timeout_s=settings.lease_timeout_s)
    except Exception:  # the store may not be migrated yet; the API's start migrates it
        log.warning("could not look for orphaned jobs", exc_info=True)
        return
    for job_id in ids:
        queue.enqueue(job_id, broker_url=settings.broker)
    if ids:
        log.warning("re-enqueued %d orphaned jobs: %s", len(ids), ids)
