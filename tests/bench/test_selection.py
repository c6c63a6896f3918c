"""bench/selection.py in its short mode: every arm runs as a real job, and what each spent is counted on
every axis, skipped steps included (an untrained base model ties every group, so `refill` pays for its
refill round on every step and trains on none)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
ARMS = ("uniform", "refill", "learnability", "tracin", "learnability+tracin")

pytestmark = pytest.mark.slow


def test_the_short_mode_compares_every_arm_on_four_axes_at_the_cost_each_paid(tmp_path):
    r = subprocess.run([sys.executable, "bench/selection.py", "--short", "--work", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = {(m["axis"], m["arm"]): m for m in (dict(re.findall(r"(\w+)=(\S+)", line))
                                                  for line in r.stdout.splitlines() if line.startswith("RESULT "))}
    assert set(results) == {(axis, arm) for axis in ("steps", "rollouts", "tokens", "seconds") for arm in ARMS}
    assert "starting weights identical across arms on 2 of 2 seeds" in r.stdout
    spent = {(axis, arm): float(m["spent"]) for (axis, arm), m in results.items()}
    steps, prompts, G = 4, 4, 8  # the short mode's
    for arm in ARMS:
        assert spent["steps", arm] == steps
        assert spent["tokens", arm] > 0 and spent["seconds", arm] > 0
    for arm in ("uniform", "learnability", "tracin", "learnability+tracin"):  # no refills: one round a step
        assert spent["rollouts", arm] == steps * prompts * G
    # every group ties: each step refills once (max_refill_rounds 1), then is skipped, its rollouts still counted
    assert spent["rollouts", "refill"] == 2 * steps * prompts * G
    assert results["rollouts", "refill"]["diff"] == "+0.000"  # an untrained model: nothing to tell apart


def test_the_environment_mode_plays_the_rows_as_an_agent_environments_tasks(tmp_path, openenv_python):
    """--environment: the jobs play bench/sums_env.py's tasks over OpenEnv (a unit of the draw is a training
    row), and an episode's tokens on the tokens axis are the model's turns alone, not the observations."""
    r = subprocess.run([sys.executable, "bench/selection.py", "--short", "--environment", "--arms", "learnability",
                        "--seeds", "1", "--work", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "GRPO_OPENENV_PYTHON": str(openenv_python)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = {(m["axis"], m["arm"]): m for m in (dict(re.findall(r"(\w+)=(\S+)", line))
                                                  for line in r.stdout.splitlines() if line.startswith("RESULT "))}
    assert set(results) == {(axis, arm) for axis in ("steps", "rollouts", "tokens", "seconds")
                            for arm in ("uniform", "learnability")}
    steps, prompts, G, turns, new_tokens = 4, 4, 8, 2, 4  # the short mode's, and the environment's turns
    for arm in ("uniform", "learnability"):
        episodes = float(results["rollouts", arm]["spent"])
        assert episodes == steps * prompts * G
        assert 0 < float(results["tokens", arm]["spent"]) <= episodes * turns * new_tokens
    out = tmp_path / "learnability-seed-0"
    [env] = [e for e in map(json.loads, (out / "events.jsonl").read_text().splitlines()) if e["type"] == "environment"]
    assert env["data"]["url"].startswith("http://127.0.0.1:")  # bench/sums_env.py's server, by URL, as a user's
    steps_m = [m["metrics"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if "selection/generated_tokens" in m["metrics"]]
    for m in steps_m:  # the episodes held more tokens than the model wrote: the observations between its turns
        assert m["selection/generated_tokens"] < m["env/episode_tokens_mean"] * m["selection/rollouts"]
