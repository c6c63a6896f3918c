"""The one rule for comparing computed floats in tests: the tolerance comes from the dtype and the
magnitude of what is compared, never from what one CPU happened to produce.

Two float computations of the same value that add the same terms in another order (another kernel,
another batch shape, another thread count) differ by up to about `n * eps * sum|terms|` (the classic
bound for a sum of n terms, Higham's gamma_n). So:

- `rtol = ulps * eps(dtype) * terms`: a few units in the last place per term summed;
- `atol = rtol * max|expected|`: an element near zero in a tensor whose other elements are large
  carries the rounding of those large values (cancellation), so it is judged on the tensor's scale.

`terms` is the length of the longest reduction behind a value (a dot product over a hidden size, a
sum over tokens, both for a gradient through a layer); pass the dtype the computation ran in when
the compared values were cast afterwards. Where a test is about the maths rather than the rounding,
run it in float64 instead. A test that needs a tighter tolerance says why where it asks for one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# The seed of every test's random numbers (tests/conftest.py): fixed, so a failure reproduces; the numerics
# script (scripts/test-numerics) runs the float-heavy tests under many, so tolerances hold for any numbers.
SEED = int(os.environ.get("GRPO_TEST_SEED", "0"))
ULPS = 4  # a few units in the last place: rounding of the inputs, the products and the final cast


def _tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach()
    return torch.as_tensor(np.asarray(x))


def tolerance(expected: Any, *, dtype: torch.dtype | None = None, terms: int = 1, ulps: float = ULPS,
              scale: float | None = None) -> tuple[float, float]:
    """`(rtol, atol)` for comparing a computed value against `expected` (tensor, array or float).
    `scale`: the magnitude of what was summed, where `expected` does not show it (a mean that should
    be 0 of values of order 1)."""
    t = _tensor(expected)
    dtype = dtype or (t.dtype if t.is_floating_point() else torch.float32)
    rtol = ulps * torch.finfo(dtype).eps * max(1, terms)
    if scale is None:
        scale = float(t.abs().max()) if t.numel() else 0.0
    return rtol, rtol * scale


def assert_close(actual: Any, expected: Any, *, dtype: torch.dtype | None = None, terms: int = 1,
                 ulps: float = ULPS, scale: float | None = None, msg: str | None = None) -> None:
    """`torch.testing.assert_close` with the tolerance of `tolerance` (tensors, arrays or floats)."""
    a, e = _tensor(actual), _tensor(expected)
    rtol, atol = tolerance(e, dtype=dtype or (a.dtype if a.is_floating_point() else None), terms=terms, ulps=ulps,
                           scale=scale)
    torch.testing.assert_close(a, e.to(a.dtype) if a.is_floating_point() else e, rtol=rtol, atol=atol,
                               check_dtype=False, msg=msg)


def approx(expected: Any, *, dtype: torch.dtype = torch.float32, terms: int = 1, ulps: float = ULPS,
           scale: float | None = None):
    """`pytest.approx` of a value computed in `dtype` (float32 unless said), with the same rule."""
    rtol, atol = tolerance(expected, dtype=dtype, terms=terms, ulps=ulps, scale=scale)
    return pytest.approx(expected, rel=rtol, abs=atol)


def _emulated_below_amx() -> bool:
    """Kernels below AVX-512 dispatched (ATEN_CPU_CAPABILITY=default or avx2) on a CPU with AMX."""
    cpuinfo = Path("/proc/cpuinfo")
    below = torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2")
    return below and cpuinfo.exists() and "amx_bf16" in cpuinfo.read_text()


# torch 2.13's bfloat16 attention on the CPU picks AMX packing from the CPU and raises ("pack_vnni2 is only
# supported when avx512 is supported") under a forced kernel set without AVX-512: no real CPU is so, but the
# numerics script's emulation is (docs/development/testing.md)
bf16_attention_runs = pytest.mark.skipif(
    _emulated_below_amx(), reason="bfloat16 attention raises in torch 2.13 under a kernel set below AVX-512 "
                                  "emulated on an AMX CPU")
