"""The one task: take a job id, run it, record the outcome (in the store, via the runner)."""

from service.queue import TASK_NAME
from service.settings import get_settings
from worker import runner
from worker.celery_app import app


@app.task(name=TASK_NAME, bind=True, max_retries=None)
def run_job(self, job_id: int) -> str:
    settings = get_settings()
    outcome = runner.run_job(job_id, settings=settings)
    if outcome == "busy":  # another worker's lease is live; look again once it could have expired
        raise self.retry(countdown=settings.lease_timeout_s)
    return outcome
