"""bench/step.py in its short mode: a step's phases timed, with the sampler's FLOPs and bandwidth shares."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_short_mode_prints_mfu_and_mbu_of_sampling(tmp_path):
    r = subprocess.run([sys.executable, "bench/step.py", "--short", "--dtype", "auto"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "GRPO_DATA_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    [result] = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    got = dict(re.findall(r"(\w+)=(\S+)", result))
    # the tiny model is far from any limit: its shares round to a few thousandths, but they are there
    assert {"mfu_sampling", "mfu_train", "mbu_sampling"} <= set(got)
    assert float(got["mbu_sampling"]) > 0 and float(got["peak_read_gbps"]) > 0
