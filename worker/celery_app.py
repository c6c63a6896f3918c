"""The Celery application of the workers (settings only; the task is in worker.tasks)."""

from celery import Celery

from service.queue import celery_config
from service.settings import get_settings

app = Celery("grpo_jobs", include=["worker.tasks"])
app.conf.update(celery_config(get_settings().broker))
