"""`grpo-jobs`, by what a command does:

- processes.py: start the service's processes (serve, worker, dev, demo);
- client.py: talk to a running service's API (submit, status, watch);
- files.py: data in and model out over the API (files upload|list|delete, download);
- local.py: work in this process on this machine (run, db upgrade, keys).

The top of the house: it may import anything, and is the one part of `service` that imports `worker`.
"""

from __future__ import annotations

from service.cli import client, files, local, processes  # noqa: F401  (registers their commands)
from service.cli.group import main

__all__ = ["main"]
