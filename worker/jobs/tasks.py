"""The tasks: take a job id, run it, record the outcome (in the store, via the runner); and join a multi-node
job's attempt as one of its nodes."""

from service.core.queue import NODE_TASK_NAME, TASK_NAME, NodeMessage
from service.core.settings import get_settings
from worker.jobs import runner
from worker.jobs.celery_app import app


@app.task(name=TASK_NAME)
def run_job(job_id: int, uid: str | None = None) -> str:
    # A busy job (another worker's lease is live) needs no retry here: if that worker dies, the
    # sweep queues the job again once its lease expires.
    return runner.run_job(job_id, settings=get_settings(), uid=uid)


@app.task(name=NODE_TASK_NAME)
def run_node(job_id: int, uid: str, gpus: int, attempt: int, node: int, endpoint: str, head: str) -> str:
    message = NodeMessage(job_id=job_id, uid=uid, gpus=gpus, attempt=attempt, node=node, endpoint=endpoint, head=head)
    return runner.run_node(message, settings=get_settings())
