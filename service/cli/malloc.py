"""Which malloc the training processes start with (`GRPO_MALLOC`).

A process's allocator is chosen when it is loaded, so the processes that train (Celery workers,
`grpo-jobs run`, and through them every rank they spawn) start with jemalloc preloaded: a step's
activations no longer fragment glibc's heap (worker/machine/allocator.py has the figures). Where the
machine has no jemalloc (Debian: `apt install libjemalloc2`), they start as they are and glibc
serves them with the worker's own settings.
"""

from __future__ import annotations

import ctypes.util
import functools
import logging
import os
import sys

from service.core.settings import Settings

log = logging.getLogger(__name__)

JEMALLOC = "jemalloc"
# jemalloc hands pages freed 10 s ago back to the OS by default, so the next step faults them in
# again: the demo's step took 26 s that way against 22 s with none handed back, for the same peak
# (2.9 GB). With GRPO_KEEP_FREED_MEMORY (the default) nothing is handed back until the job ends. Kept
# pages coalesce into large free extents, which jemalloc by default splits only for requests at least
# 1/64 of their size (lg_extent_max_active_fit:6): a SmolLM2 step whose prompts are computed once per
# group (small activations) then found nothing it could reuse and grew by 0.9 GB a step (3.0 to 6.4 GB
# in 5 steps); letting any kept extent serve any request holds it at 2.7 GB.
KEEP_FREED = "dirty_decay_ms:-1,muzzy_decay_ms:-1,lg_extent_max_active_fit:16"
CUDA_ALLOC_CONF = "expandable_segments:True"
CUDA_ALLOC_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# A CPU multiplies bfloat16 with oneDNN, which compiles kernels for each new matmul shape and keeps the last
# 1,024 shapes', and torch's ideep keeps 1,024 more (together about 1 MB a shape, measured). A step's rows
# (micro-batch x length) take new counts every step, so a job's resident memory crept for hundreds of steps
# (tiny model, bfloat16, jemalloc: +189 MiB over steps 2-400). These bounds hold it flat from step 20 at the
# same step time (docs/training/grpo.md); an admin's own values win.
KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "64"}


@functools.cache
def jemalloc_library() -> str | None:
    """The shared library to preload, by the name the dynamic linker finds it under. (Not opened
    here: jemalloc loaded after start-up finds no room for its thread-local state.)"""
    return ctypes.util.find_library(JEMALLOC)


def training_env(settings: Settings, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a training process starts with: `env` (this one's by default) with the
    chosen malloc preloaded, and the CUDA allocator's settings under both names it is read by."""
    env = dict(os.environ if env is None else env)
    # torch >= 2.9 reads PYTORCH_ALLOC_CONF first, older torch (and other stacks, a vLLM venv's own torch)
    # PYTORCH_CUDA_ALLOC_CONF: one value, the admin's where set, under both. Expandable segments by default:
    # a step's tensors of changing sizes (completions of every length) reuse one growing segment instead of
    # leaving blocks the next step's sizes do not fit (vLLM's sleep mode turns them off for its own pool).
    conf = env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or CUDA_ALLOC_CONF
    env.update(dict.fromkeys(CUDA_ALLOC_NAMES, conf))
    env.update({name: env.get(name) or size for name, size in KERNEL_CACHES.items()})
    if settings.malloc != JEMALLOC:
        return env
    lib = jemalloc_library()
    if lib is None:
        log.warning("GRPO_MALLOC=jemalloc but no libjemalloc on this machine: training processes use glibc")
        return env
    preload = env.get("LD_PRELOAD", "")
    if lib not in preload.split():
        env["LD_PRELOAD"] = f"{lib} {preload}".strip()
    if settings.keep_freed_memory:
        env.setdefault("MALLOC_CONF", KEEP_FREED)  # an admin's own jemalloc options win
    return env


def reexec_for_training(settings: Settings) -> None:
    """Start this command again with the chosen malloc, unless it already has it (or none is
    found). Returns only when nothing changed."""
    env = training_env(settings)
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        # read when CUDA first allocates and when the first kernel is cached: in time
        os.environ.update({k: env[k] for k in (*CUDA_ALLOC_NAMES, *KERNEL_CACHES)})
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "service.cli", *sys.argv[1:]], env)
