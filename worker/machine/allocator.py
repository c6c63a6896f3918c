"""Allocator settings for training on a CPU.

Workers and `grpo-jobs run` start with jemalloc preloaded where the machine has it
(`GRPO_MALLOC`, service/cli/malloc.py). Its size classes keep a step's 12-32 MB activations from
fragmenting the heap: a 256-token SmolLM2 step peaked at 2.1 GB under jemalloc (freed pages kept
for the next step, service/cli/malloc.py's MALLOC_CONF) against 5.7 GB under glibc with the
settings below.
Without jemalloc, glibc serves the process, with these settings:

By default glibc serves each allocation above a dynamic threshold (at most 32 MB: logits,
activations) with a fresh mmap and unmaps it when freed, and trims freed memory from the top of
the heap. A training step then faults every page of its activations in again, zeroed by the
kernel: on a 2-core VM, 1.6M page faults and 16 s of system time in a 12 s TracIn scoring pass,
whose time swung 12-23 s with the allocator's state. Serving them from the heap and keeping freed
memory lets the next step reuse the same pages (no faults, 11-13 s every time). bench/tracin.py's
loops (SmolLM2, N=32), one run with and one without: GRPO 19.5 vs 21.6 s/step, TracIn 23.3 vs
27.1, peak RSS during steps 3469 vs 3590 MB and 3606 vs 3848 MB. The heap can still fragment: a
synthetic loop of 64 MiB buffers on two threads grew from 0.75 to 1.3 GB over 300 steps (0.5 GB
with glibc's defaults). The process keeps its peak until `release_freed_memory` (when a job ends).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
_MMAP_ABOVE = 2**31 - 1  # mallopt takes an int: allocations over 2 GiB still get their own mapping


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc only (not musl, not macOS)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


@functools.cache
def _jemalloc_ctl():
    """jemalloc's `mallctl` where jemalloc serves this process (preloaded), else None."""
    try:
        return ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None


def jemalloc_active() -> bool:
    return _jemalloc_ctl() is not None


def keep_freed_memory() -> bool:
    """glibc: serve allocations up to 2 GiB from the heap and never trim it. False where glibc
    does not serve the process (jemalloc keeps and reuses freed pages on its own) or is not there."""
    libc = _glibc()
    if libc is None or jemalloc_active():
        return False
    # -1 disables trimming (documented in mallopt(3)); a fixed mmap threshold also stops glibc's
    # dynamic one from moving.
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, _MMAP_ABOVE)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
    if not ok:
        log.warning("glibc refused the malloc settings; freed memory is returned as usual")
    return ok


def prepare_for_steps(*, keep_freed: bool) -> str:
    """After loading, before the first step: hand back what loading used, then (glibc) keep what
    each step frees for the next one. Returns the malloc serving the process, for the job's events."""
    release_freed_memory()
    if jemalloc_active():
        return "jemalloc"
    return "glibc, freed memory kept" if keep_freed and keep_freed_memory() else "glibc"


_ALL_ARENAS = 4096  # MALLCTL_ARENAS_ALL, from jemalloc's jemalloc.h


def release_freed_memory() -> None:
    """Hand the memory freed so far back to the OS (a long-lived worker between jobs)."""
    if (mallctl := _jemalloc_ctl()) is not None:
        mallctl(f"arena.{_ALL_ARENAS}.purge".encode(), None, None, None, ctypes.c_size_t(0))
        return
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
