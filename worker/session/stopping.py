"""A worker told to stop (SIGTERM: Celery's warm shutdown) waits for the jobs its pool processes are
running. A training job ends at its own pace; a session run would wait for its client to go quiet. So
the main process passes the news on to its pool processes (SIGUSR2), and a session run there hands
itself back at its next clean point: state saved, the run queued again (or idle), its pending
operations kept for the worker that takes it next."""

from __future__ import annotations

import os
import signal
import threading

_stopping = threading.Event()


def stopping() -> bool:
    """Whether this process's worker was told to stop."""
    return _stopping.is_set()


def deaf() -> None:
    """In a new pool process: SIGUSR2 is ignored until a job runs. (billiard then leaves it be: a signal
    it finds handled, it makes end the process.)"""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def listen() -> None:
    """In a pool process, as a job starts: SIGUSR2 from the main process means the worker is stopping."""
    signal.signal(signal.SIGUSR2, lambda *_: _stopping.set())


def tell_pool() -> None:
    """In the main process, on a warm shutdown: every pool process hears that the worker is stopping."""
    from billiard.process import active_children  # the pool's processes are the main process's children

    for child in active_children():  # no logging here: this runs in a signal handler
        try:
            os.kill(child.pid, signal.SIGUSR2)
        except ProcessLookupError:  # it ended meanwhile
            pass
