"""The Celery application of the workers (settings and process hooks; the task is in worker.jobs.tasks)."""

import logging

from celery import Celery
from celery.signals import (
    task_prerun,
    worker_init,
    worker_process_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from service.core import queue
from service.core.settings import get_settings
from service.store.db import dispose_engines
from worker.session import stopping

app = Celery("grpo_jobs", include=["worker.jobs.tasks"])
app.conf.update(queue.celery_config(get_settings().broker))
log = logging.getLogger(__name__)
_sweeper = None


@worker_init.connect
def _preload_loops(**_kwargs) -> None:
    from worker.jobs.runner import preload

    preload()


@worker_process_init.connect
def _forget_parent_connections(**_kwargs) -> None:
    """A pool child is forked from the main process, which holds pooled store connections (the
    sweep's). Sharing one socket between processes corrupts both sessions (on PostgreSQL:
    'prepared statement "_pg3_0" already exists'), so the child drops them unclosed."""
    dispose_engines(close=False)


@worker_process_init.connect
def _deaf_until_a_job_runs(**_kwargs) -> None:
    stopping.deaf()


@task_prerun.connect
def _listen_for_stop(**_kwargs) -> None:
    stopping.listen()


@worker_shutting_down.connect
def _tell_pool(how: str = "", **_kwargs) -> None:
    """A warm shutdown waits for the running jobs: a session run among them hands itself back."""
    if how == "Warm":
        stopping.tell_pool()


@worker_ready.connect
def _start_sweeper(**_kwargs) -> None:
    global _sweeper
    from worker.jobs.sweeper import sweeper

    _sweeper = sweeper(get_settings())
    _sweeper.start()


@worker_shutdown.connect
def _stop_sweeper(**_kwargs) -> None:
    if _sweeper is not None:
        _sweeper.stop()
