"""What a step held in memory: this process's resident set now and at its peak since the step
began, and on a GPU the peak the caching allocator handed out.

Linux keeps a process's peak resident set (VmHWM) and resets it when "5" is written to
/proc/self/clear_refs, so a step's own peak is measurable in a worker that outlives many jobs.
Elsewhere (no /proc) the CPU figures are absent rather than wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
GB = 2**30


@dataclass(frozen=True)
class MemoryUse:
    rss_gb: float | None  # resident set at the end of the step
    peak_rss_gb: float | None  # highest resident set since `reset_peak`
    cuda_peak_gb: float | None  # highest allocated CUDA memory since `reset_peak` (None off the GPU)

    def metrics(self) -> dict[str, float]:
        named = {"memory/rss_gb": self.rss_gb, "memory/peak_rss_gb": self.peak_rss_gb,
                 "memory/cuda_peak_gb": self.cuda_peak_gb}
        return {k: v for k, v in named.items() if v is not None}


def _status_kb(*fields: str) -> dict[str, int]:
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return {}
    got = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in fields:
            got[key] = int(rest.split()[0])
    return got


def reset_peak(device: torch.device) -> None:
    """Start measuring a new peak (the step's), for the process and the device."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass  # not Linux, or /proc read-only: the peak is then the process's since it started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def measure(device: torch.device) -> MemoryUse:
    kb = _status_kb("VmRSS", "VmHWM")
    cuda = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
    rss, hwm = kb.get("VmRSS"), kb.get("VmHWM")
    return MemoryUse(rss_gb=None if rss is None else rss * 1024 / GB,
                     peak_rss_gb=None if hwm is None else hwm * 1024 / GB, cuda_peak_gb=cuda)
