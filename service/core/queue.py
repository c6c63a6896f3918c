"""The broker seen from the API: enqueue by task name, never importing the worker (or torch).

A job's message goes to the queue of the GPUs it needs on one worker: `jobs` for none, which every worker
consumes, `gpu` for one and `gpuN` for N, which a worker consumes when it has that many (worker/machine/inventory.py).
A job that needs GPUs no worker has waits in its queue, never on a CPU.

The Celery settings for long GPU jobs live here so the producer and worker/jobs/celery_app.py agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from celery import Celery

TASK_NAME = "grpo_jobs.run_job"
NODE_TASK_NAME = "grpo_jobs.run_node"
ANY_WORKER = "jobs"
# Longer than any job: a message not acked within this is redelivered to another worker.
VISIBILITY_TIMEOUT_S = 7 * 24 * 3600


def _transport_options(broker_url: str) -> dict[str, Any]:
    # Redis redelivers unacked messages after the visibility timeout; it must outlast any job.
    # kombu's SQLAlchemy transport hands its options to create_engine, so it takes none.
    if broker_url.startswith(("redis", "rediss")):
        return {"visibility_timeout": VISIBILITY_TIMEOUT_S}
    return {}


def celery_config(broker_url: str) -> dict[str, Any]:
    return {
        "broker_url": broker_url,
        "task_default_queue": ANY_WORKER,
        "task_acks_late": True,  # ack after the job, so a crashed worker's job is redelivered
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,  # one job at a time per worker process
        "worker_max_tasks_per_child": 1,  # a fresh process per job: no leaked GPU memory
        # A broker blip must not kill a running job: the SQL lease, not the broker connection,
        # decides who runs it, and its message was taken; with Redis the late ack may be lost
        # with the connection, and a redelivery of a finished job is skipped.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "broker_transport_options": _transport_options(broker_url),
        "broker_connection_retry_on_startup": True,
        "task_ignore_result": True,  # results live in the SQL store
        "worker_hijack_root_logger": False,
        "task_serializer": "json",
        "accept_content": ["json"],
    }


@lru_cache(maxsize=4)
def producer(broker_url: str) -> Celery:
    app = Celery("grpo_jobs_api")
    app.conf.update(celery_config(broker_url))
    return app


@dataclass(frozen=True)
class Message:
    """A job to run, as its message says it: by id and uid (a worker on another store with a job of the same
    id, a shared broker or a restored database, drops it), on the queue of the GPUs it needs."""

    job_id: int
    uid: str
    gpus: int  # the job's `gpus` column: the GPUs it needs on one worker


@dataclass(frozen=True)
class NodeMessage:
    """Node `node` (1 or more) of a multi-node job's attempt, sent by its node 0, which hosts the attempt's
    rendezvous at `endpoint`; on the queue of the GPUs the job needs on each worker."""

    job_id: int
    uid: str
    gpus: int
    attempt: int
    node: int
    endpoint: str  # host:port
    head: str  # node 0's lease holder: a message of an attempt that was given back and leased again is stale


def queue_for(gpus: int) -> str:
    """The queue of a job that needs `gpus` GPUs on one worker."""
    return ANY_WORKER if gpus == 0 else "gpu" if gpus == 1 else f"gpu{gpus}"


def worker_queues(gpus: int) -> list[str]:
    """The queues a worker with `gpus` GPUs consumes: every job it can hold."""
    return [queue_for(n) for n in range(gpus + 1)]


def enqueue(message: Message, *, broker_url: str, countdown_s: float = 0.0) -> None:
    """Send `message` to a worker of its queue; with `countdown_s`, no worker runs it before then (the worker
    holding it meanwhile takes other work)."""
    producer(broker_url).send_task(TASK_NAME, args=[message.job_id, message.uid], queue=queue_for(message.gpus),
                                   countdown=countdown_s or None)


def enqueue_node(message: NodeMessage, *, broker_url: str) -> None:
    producer(broker_url).send_task(NODE_TASK_NAME, kwargs=asdict(message), queue=queue_for(message.gpus))


def broker_reachable(broker_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with producer(broker_url).connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout_s)
        return True
    except Exception:  # any transport error means "not ready"
        return False
