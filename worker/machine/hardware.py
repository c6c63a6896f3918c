"""What a step's utilisation is measured against: a model's decoder shapes (from its config) and this
device's peak FLOP/s (measured). Torch and transformers alone, so bench/device_check.py uses them on a
machine that has nothing else of the service."""

from __future__ import annotations

import functools
import time

import torch

from worker.algos import flops
from worker.algos.lora import base_model

PEAK_SIZE = {"cpu": 1024, "cuda": 8192}  # square matmul sides: long enough to reach the rate, short to time


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


@functools.cache
def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul on `device` in `dtype` (at least float32 on a CPU, where half-precision
    matmuls are emulated): the best of five after a warm-up. Measured once per process."""
    n = PEAK_SIZE.get(device.type, 1024)
    if device.type == "cpu":
        dtype = torch.promote_types(dtype, torch.float32)
    own = torch.Generator(device).manual_seed(0)  # the job's random stream stays untouched
    a = torch.randn(n, n, device=device, dtype=dtype, generator=own)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=own)
    best = float("inf")
    for i in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is the warm-up
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
