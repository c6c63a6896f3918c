"""The SQL store: models and keyword-only query functions. All SQL lives in this package; it imports
`service.core` and SQLAlchemy, never the API or the worker.

The commit rule: a store function never commits a session it was handed. The caller's
`session_scope` (or a route's `SessionDep`) is the transaction, and it commits once, when the
request or the unit of work ends. The one exception is the lease state machine
(`service/store/leases.py`): every transition of a job, its submission included, is a transaction
of its own, so its functions take the store's URL and open, and commit, their own scope; so is
an API key's last-used stamp (`keys._touch`), which no request should hold a lock for. Routes
never commit: `SessionDep` does, when the request ends; what must follow the commit (telling a
worker about new rows) is registered with `db.after_commit`.
"""
