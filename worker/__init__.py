"""The compute: the job host (tasks, celery_app, runner, sql_reporter, sweeper: the only modules here that
may import `service.store`), the loops, the engines, models, rewards and the math; `service.core` beside."""
