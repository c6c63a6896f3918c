"""bench/device_check.py, the script for a GPU machine, in its CPU mode: it runs with torch,
transformers and peft alone (the service's own dependencies blocked), prints its table, and holds
every row to its bound. On a GPU the same rows run on cuda (docs/development/device-check.md)."""

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).parents[2]
BLOCKED = ("pydantic", "pydantic_settings", "fastapi", "sqlalchemy", "celery", "redis", "alembic")  # not transformers' own


def test_the_short_mode_runs_without_the_services_dependencies_and_prints_its_table(tmp_path):
    blocker = "import sys, runpy\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in BLOCKED) + \
        "sys.argv = ['device_check.py', '--short', '--device', 'cpu', '--json', sys.argv[1]]\n" \
        "runpy.run_path('bench/device_check.py', run_name='__main__')\n"
    r = subprocess.run([sys.executable, "-c", blocker, str(tmp_path / "rows.json")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| check | model | measured | bound | verdict |"
    checks = [line.split(" | ")[0].removeprefix("| ") for line in table[2:]]
    assert checks == ["agreement", "bf16", "ratio", "fp32 head", "sdpa float32", "sdpa bfloat16", "memory", "generate", "mfu"]
    assert "RESULT rows=9 over_bound=0" in r.stdout
    assert (tmp_path / "rows.json").exists()


def test_a_step_on_two_devices_agrees_the_way_the_gpu_row_measures_it():
    """The agreement row's code, with the CPU on both sides (where the GPU's row compares cuda with the
    CPU): the same weights and the same step give the same log-probs before and after it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import device_check

    b = device_check.batch(4, 12, 8, device_check.SHAPES["tiny"][1]["vocab_size"])
    [row] = device_check.check_agreement("tiny", "cpu", b)
    assert row.verdict == "ok" and "0.0e+00 before, 0.0e+00 after the step" in row.measured, row
    # and the step really moved the weights: the same model's log-probs before and after differ
    model = device_check.build("tiny", torch.float32, "cpu")
    before = device_check.logprobs(model, b, "cpu")
    device_check.grpo_step(model, b, "cpu")
    assert (device_check.logprobs(model, b, "cpu") - before).abs().max() > 1e-4
