"""The Celery application of the workers (settings and process hooks; the task is in worker.jobs.tasks)."""

import logging
import os
import socket
import uuid

from celery import Celery
from celery.signals import (
    celeryd_after_setup,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from service.core import queue
from service.core.records import WorkerInfo
from service.core.settings import get_settings
from service.store import workers as workers_q
from service.store.periodic import Periodic
from worker.machine import inventory
from worker.session import stopping

app = Celery("grpo_jobs", include=["worker.jobs.tasks"])
app.conf.update(queue.celery_config(get_settings().broker))
log = logging.getLogger(__name__)
_sweeper: Periodic | None = None
_me: WorkerInfo | None = None


@celeryd_after_setup.connect
def _consume_what_it_can_run(sender: str, instance, **_kwargs) -> None:
    """The queues of every job this worker's GPUs can hold (service/core/queue.py), beside the `jobs` queue
    its command line names: a worker with two GPUs also takes the jobs that need one or two."""
    global _me
    gpus = inventory.gpus()
    queues = queue.worker_queues(len(gpus))
    for name in queues:
        instance.app.amqp.queues.select_add(name)
    _me = WorkerInfo(name=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
                     hostname=get_settings().node, gpus=gpus, queues=queues, concurrency=instance.concurrency)
    log.info("worker %s: %d GPU(s) %s, queues %s", _me.name, len(gpus), [g.name for g in gpus], queues)


@worker_init.connect
def _preload_loops(**_kwargs) -> None:
    from worker.jobs.runner import preload

    preload()


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

    _sweeper = sweeper(get_settings(), _me)  # and says it is alive, every sweep; gone after the lease timeout
    _sweeper.start()


@worker_shutdown.connect
def _stop_sweeper(**_kwargs) -> None:
    if _sweeper is not None:
        _sweeper.stop()
    if _me is not None:
        try:
            workers_q.leave(get_settings().store_url, name=_me.name)
        except Exception as exc:  # the store is away: the row expires with the lease timeout
            log.warning("could not leave the worker registry (%s)", type(exc).__name__)
