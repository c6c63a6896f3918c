"""This process's resident memory, for the benchmarks: now, its peak, and a sampler for a window.

Read from /proc, not `ru_maxrss`: Linux carries ru_maxrss over exec from the parent process, so
a child started by a bench would report its parent's peak instead of its own.
"""

from __future__ import annotations

import threading


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def rss_mb() -> float:
    """Resident memory now."""
    return _status_mb("VmRSS")


def high_water_mb() -> float:
    """This process's peak resident memory since it started."""
    return _status_mb("VmHWM")


class PeakRss:
    """Samples resident memory every `every_s` in a thread, from `arm()` (or entering) on:

        with PeakRss() as peak:
            work()
        peak.peak_mb
    """

    def __init__(self, every_s: float = 0.005) -> None:
        self.every_s = every_s
        self.peak_mb = rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def arm(self) -> None:
        """Start the peak over from now (so a phase before it, like loading a model, does not count)."""
        self.peak_mb = rss_mb()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak_mb = max(self.peak_mb, rss_mb())

    def start(self) -> PeakRss:
        self._thread.start()
        return self

    def __enter__(self) -> PeakRss:
        self.arm()
        return self.start()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
