"""How long a job's ranks take to start, side by side: each rank spawned as a fresh interpreter that
imports torch, transformers, peft and the loops itself (multiprocessing's `spawn`), against ranks
forked from a fork server that imported them once (`forkserver`, what worker/parallel/launch.py does).

    python bench/rank_start.py [--processes 2] [--launches 3]

A launch is timed from the call to its return, its ranks doing nothing but import the loops (as a job's
rank does first) and join the process group;
the fork server's first launch includes starting the server (once per worker process), reported
apart. The machine's busy CPU time over each method's launches is read from /proc/stat. Ends with:
RESULT spawn_s=... forkserver_first_s=... forkserver_s=... speedup=... spawn_cpu_s=... forkserver_cpu_s=...
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import worker.jobs.runner  # noqa: F401  names the loops the fork server preloads, as a worker does
from worker.parallel import launch as launcher


def _entry(*, ranks) -> int:
    worker.jobs.runner.preload()  # what a rank's loop imports first: free where the server imported it
    return ranks.rank


def _busy_s() -> float:
    """The machine's CPU seconds spent busy so far (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / 100


def _timed(processes: int) -> tuple[float, float]:
    import rank_start  # this file by its module name: what a rank can import (bench/ is on the path)

    t0, c0 = time.perf_counter(), _busy_s()
    out = launcher.launch(rank_start._entry, (), processes=processes)
    assert sorted(out) == list(range(processes)), out
    return time.perf_counter() - t0, _busy_s() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--launches", type=int, default=3)
    a = ap.parse_args()
    launcher.START_METHOD = "spawn"
    spawn = [_timed(a.processes) for _ in range(a.launches)]
    launcher.START_METHOD = "forkserver"
    first = _timed(a.processes)
    forked = [_timed(a.processes) for _ in range(a.launches)]
    spawn_s, fork_s = statistics.median(w for w, _ in spawn), statistics.median(w for w, _ in forked)
    print(f"{a.processes} ranks, median of {a.launches} launches: spawn {spawn_s:.2f} s, fork server {fork_s:.2f} s "
          f"(its first launch, starting the server: {first[0]:.2f} s)")
    print(f"RESULT spawn_s={spawn_s:.3f} forkserver_first_s={first[0]:.3f} forkserver_s={fork_s:.3f} "
          f"speedup={spawn_s / fork_s:.2f} spawn_cpu_s={statistics.median(c for _, c in spawn):.2f} "
          f"forkserver_cpu_s={statistics.median(c for _, c in forked):.2f}")


if __name__ == "__main__":
    main()
