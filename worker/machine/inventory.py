"""What a worker has to run jobs on: its GPUs, read once at start, and so the queues it consumes.

The worker's main process forks its pool, and a process that has initialised CUDA cannot hand it to a
forked child, so the GPUs are read by a short child interpreter; on a machine with no GPU driver (no
/dev/nvidia* or /dev/kfd) nothing is started at all. The child sees the worker's CUDA_VISIBLE_DEVICES,
so a worker given `4,6` has two GPUs, cuda:0 and cuda:1, as its jobs will.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from service.core.records import GpuInfo

log = logging.getLogger(__name__)
DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's, ROCm's (torch.cuda drives both)
_READ = ("import json, torch\n"
         "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
         "props = [torch.cuda.get_device_properties(i) for i in range(n)]\n"
         "print(json.dumps([[p.name, p.total_memory] for p in props]))")


def gpus(timeout_s: float = 120.0) -> list[GpuInfo]:
    """The GPUs this process's children would see; [] where there is no driver, none is visible, or reading
    them fails (said in the log: the worker then runs the jobs that need none)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1") or not any(map(os.path.exists, DRIVER_NODES)):
        return []
    try:
        out = subprocess.run([sys.executable, "-c", _READ], capture_output=True, text=True, timeout=timeout_s,
                             check=True, cwd=Path(__file__).resolve().parents[1]).stdout
        return [GpuInfo(index=i, name=name, memory_bytes=memory) for i, (name, memory) in enumerate(json.loads(out))]
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        log.warning("could not read this worker's GPUs (%s): it takes only jobs that need none", exc)
        return []
