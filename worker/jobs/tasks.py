"""The one task: take a job id, run it, record the outcome (in the store, via the runner)."""

from service.core.queue import TASK_NAME
from service.core.settings import get_settings
from worker.jobs import runner
from worker.jobs.celery_app import app


@app.task(name=TASK_NAME)
def run_job(job_id: int, uid: str | None = None) -> str:
    # A busy job (another worker's lease is live) needs no retry here: if that worker dies, the
    # sweep queues the job again once its lease expires.
    return runner.run_job(job_id, settings=get_settings(), uid=uid)
