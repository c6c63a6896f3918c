"""`model.dtype: auto`: the frozen base weights in bfloat16 where this device multiplies bfloat16 natively
(faster than float32: GPUs' tensor cores, CPUs with AMX or AVX512-BF16), else float32.

The probe times a square matmul in both dtypes (the best of a few after a warm-up) and is cached per
machine and device in a small JSON file, so every job, and every process of a job, on the machine decides
alike. Trainable weights never follow: a LoRA adapter and its AdamW state stay float32, and full
fine-tuning steps float32 master weights (worker/algos/optim.py), because AdamW's
steps fall below bfloat16's resolution.

`model.activations` says what flows between the low-precision matmuls. On a CPU it is float32 (`auto`):
each frozen linear layer multiplies in bfloat16 and hands float32 on (worker/model/loading.py), because
bfloat16 activations round a LoRA adapter's early updates away in every layer's sum with its base output,
at about bfloat16's speed (bench/precision.py). A GPU's attention kernels want the weights' dtype.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.machine.hardware import cpu_name, matmul_flops

if TYPE_CHECKING:
    from service.core.settings import Settings

PROBE_SIZE = {"cpu": 1024, "cuda": 4096}  # square sides: long enough to reach the rate, short to time (< 0.2 s)
NATIVE = 1.5  # bfloat16 counts as native when it multiplies at least this much faster than float32


@dataclass(frozen=True)
class Probe:
    """The device's matmul rates, float32 and bfloat16 (FLOP/s)."""

    device: str  # what was measured: the device and, on a CPU, its model and torch's threads
    float32_flops: float
    bfloat16_flops: float

    @property
    def speedup(self) -> float:
        return self.bfloat16_flops / self.float32_flops


@dataclass(frozen=True)
class Precision:
    """The dtype the base weights load in, and why."""

    dtype: str  # a ModelSpec dtype: float32, bfloat16, float16 or float64
    reason: str
    probe: Probe | None = None  # with `auto`
    cached: bool = False  # the probe came from the machine's cache
    activations: str = "weights"  # float32 or weights: the dtype between a low-precision model's matmuls
    auto: bool = False  # `model.dtype: auto` chose it

    def data(self) -> dict[str, object]:
        """For the `memory_plan` event."""
        return {"dtype": self.dtype, "activations": self.activations, "reason": self.reason, "auto": self.auto,
                "cached": self.cached, "probe": None if self.probe is None else asdict(self.probe)}


def device_key(device: torch.device) -> str:
    """The machine and device a probe holds for."""
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        what = f"{cpu_name()}, {torch.get_num_threads()} threads"
    return f"{socket.gethostname()}/{device.type}: {what} (torch {torch.__version__})"


def probe(device: torch.device, cache: Path | None, *, timer=None) -> tuple[Probe, bool]:
    """The device's rates, from `cache` (a JSON file: key -> probe) where it has them, else measured by
    `timer` (matmul_flops) and written there; and whether they came from the cache."""
    key = device_key(device)
    known: dict[str, dict] = {}
    if cache is not None and cache.exists():
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}  # a torn or foreign file: measure again and rewrite it
        if isinstance(known.get(key), dict):
            try:
                return Probe(**known[key]), True
            except TypeError:
                pass
    n, timer = PROBE_SIZE.get(device.type, 1024), timer or matmul_flops
    found = Probe(key, timer(device, torch.float32, n), timer(device, torch.bfloat16, n))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**known, key: asdict(found)}, indent=1))
        tmp.replace(cache)  # whole or not at all: a concurrent reader sees the old file or this one
    return found, False


def choose(requested: str, device: torch.device, *, cache: Path | None, bfloat16_ok: str | None = None,
           timer=None, auto: str = "probe") -> Precision:
    """What `model.dtype` loads as on `device`. `auto` is bfloat16 where the probe finds it native
    (at least NATIVE x float32's rate) and `bfloat16_ok` names no reason against it, else float32;
    `auto` (GRPO_AUTO_DTYPE) other than `probe` names the dtype instead of the probe."""
    if requested != "auto":
        return Precision(requested, "model.dtype names it")
    if bfloat16_ok is not None:
        return Precision("float32", f"auto: float32, as {bfloat16_ok}", auto=True)
    if auto != "probe":
        return Precision(auto, f"auto: {auto}, as GRPO_AUTO_DTYPE names it", auto=True)
    rates, cached = probe(device, cache, timer=timer)
    words = (f"bfloat16 multiplies at {rates.bfloat16_flops / 1e9:,.0f} GFLOP/s against float32's "
             f"{rates.float32_flops / 1e9:,.0f} on {device.type} ({rates.speedup:.1f}x)")
    if rates.speedup >= NATIVE:
        return Precision("bfloat16", f"auto: bfloat16 base weights, as {words}", rates, cached, auto=True)
    return Precision("float32", f"auto: float32, as {words}: not native", rates, cached, auto=True)


LOW_PRECISION = ("bfloat16", "float16")


def activations_for(requested: str, dtype: str, device: torch.device) -> str:
    """What `model.activations` is for base weights of `dtype` on `device`: float32 or weights (`auto`:
    float32 on a CPU, the weights' dtype elsewhere; a float32 or float64 model's are its own)."""
    if dtype not in LOW_PRECISION:
        return "weights"
    if requested != "auto":
        return requested
    return "float32" if device.type == "cpu" else "weights"


def resolve(requested_dtype: str, requested_activations: str, device: torch.device, *, cache: Path | None,
            bfloat16_ok: str | None = None, timer=None, auto: str = "probe") -> Precision:
    """`choose`, with the activations' dtype resolved for what it chose."""
    prec = choose(requested_dtype, device, cache=cache, bfloat16_ok=bfloat16_ok, timer=timer, auto=auto)
    acts = activations_for(requested_activations, prec.dtype, device)
    reason = f"{prec.reason}, float32 activations" if acts == "float32" else prec.reason
    return replace(prec, activations=acts, reason=reason)


def resolve_as_set(requested_dtype: str, requested_activations: str, device: torch.device, settings: Settings, *,
                   bfloat16_ok: str | None = None) -> Precision:
    """`resolve` as the admin set it up: GRPO_AUTO_DTYPE, and the probe every job on the machine shares."""
    return resolve(requested_dtype, requested_activations, device, cache=settings.precision_cache,
                   bfloat16_ok=bfloat16_ok, auto=settings.auto_dtype)
