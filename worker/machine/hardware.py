"""What a step's utilisation is measured against: a model's decoder shapes (from its config) and this
device's peak FLOP/s and memory read bandwidth (measured). Torch and transformers alone, so
bench/device_check.py uses them on a machine that has nothing else of the service."""

from __future__ import annotations

import functools
import platform
import time
from pathlib import Path

import torch

from worker.algos import flops
from worker.algos.lora import base_model

PEAK_SIZE = {"cpu": 1024, "cuda": 8192}  # square matmul sides: long enough to reach the rate, short to time
READ_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}  # what the bandwidth probe reads: far past the caches


@functools.cache
def cpu_name() -> str:
    """The CPU's model name (what the fingerprint and the precision probe's cache name the machine by)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def decoder_shape(model: torch.nn.Module) -> flops.DecoderShape | None:
    """The shapes that set a model's FLOPs, from its (text) config; None for a config that does not name
    them the way Llama-style decoders do (its steps then report no mfu/*)."""
    base = base_model(model)
    c = base.config.get_text_config(decoder=True)
    named = {k: getattr(c, k, None) for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                "num_attention_heads", "vocab_size")}
    if not all(isinstance(v, int) and v > 0 for v in named.values()):
        return None
    heads = named["num_attention_heads"]
    return flops.DecoderShape(
        layers=named["num_hidden_layers"], hidden=named["hidden_size"], intermediate=named["intermediate_size"],
        heads=heads, kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or named["hidden_size"] // heads, vocab=named["vocab_size"])


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, *, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul in `dtype` on `device`: the best of `repeats` after a warm-up."""
    own = torch.Generator(device).manual_seed(0)  # the job's random stream stays untouched
    a = torch.randn(n, n, device=device, generator=own).to(dtype)
    b = torch.randn(n, n, device=device, generator=own).to(dtype)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is the warm-up
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


@functools.cache
def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul on `device` in `dtype`, the best of five after a warm-up: the rate of the
    weights' own dtype (a CPU with AMX multiplies bfloat16 several times faster than float32; one without
    emulates it, slower). Measured once per process."""
    return matmul_flops(device, dtype, PEAK_SIZE.get(device.type, 1024))


@functools.cache
def peak_bandwidth(device: torch.device) -> float:
    """Bytes a second this process reads from `device`'s memory: a float32 sum over READ_BYTES, the best of five
    after a warm-up (its threads, as the job's sampler reads with them). Measured once per process."""
    x = torch.ones(READ_BYTES.get(device.type, 256 << 20) // 4, device=device)
    best = float("inf")
    for i in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best
