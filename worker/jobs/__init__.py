"""The job host: the Celery app and task, the runner that leases a job and runs its loop, the SQL
reporter and the sweep. The only rooms of the worker that may import `service.store`."""
