"""bench/precision.py in its short mode: every variant measured against float32, side by side."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_short_mode_compares_each_precision_with_float32(tmp_path):
    r = subprocess.run([sys.executable, "bench/precision.py", "--short", "--b", "1e-3"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "GRPO_DATA_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {got["variant"]: got for got in (dict(re.findall(r"(\w+)=(\S+)", line))
                                             for line in r.stdout.splitlines() if line.startswith("RESULT "))}
    assert set(rows) == {"float32", "bfloat16", "bfloat16+float32-activations", "bfloat16+float32-activations+fp32-head"}
    assert rows["float32"]["grad_cos"] == "1.00000" and rows["float32"]["logp_gap"] == "0.0000"
    assert float(rows["float32"]["sampler_cos"]) > 0.999  # a float32 fold is the unfolded adapter, bar rounding
    for name in set(rows) - {"float32"}:  # rounded, so off float32, but by little
        assert 0.99 < float(rows[name]["grad_cos"]) < 1.0 and 0 < float(rows[name]["logp_gap"]) < 0.05
        assert float(rows[name]["decode_s"]) > 0 and float(rows[name]["train_ratio"]) > 0
