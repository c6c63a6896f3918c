"""The HTTP API: one module per resource, its dependencies (deps.py) and its error shapes. It imports the
core and the store, never the worker; its routes never commit (the store's rule)."""
