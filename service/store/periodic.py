"""A daemon thread that runs one function every few seconds until its process stops: the lease sweep
(in a worker's main process) and the webhook deliverer (in an API process)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from service.store.db import dispose_engines

log = logging.getLogger(__name__)


class Periodic:
    """`fn()` every `every_s` seconds (first at once, or after one interval with `delay_first`). A
    failure is logged and the next round tries again. Between rounds it holds no store connection:
    a worker's pool processes are forked from its main process."""

    def __init__(self, name: str, fn: Callable[[], object], every_s: float, *, delay_first: bool = False) -> None:
        self.name, self.fn, self.every_s, self.delay_first = name, fn, every_s, delay_first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        if self.delay_first and self._stop.wait(self.every_s):
            return
        while True:
            try:
                self.fn()
            except Exception as exc:  # store or broker away: the next round tries again
                log.warning("%s failed (%s: %s); retrying in %.0f s", self.name, type(exc).__name__, exc,
                            self.every_s)
            dispose_engines(close=True)
            if self._stop.wait(self.every_s):
                return
