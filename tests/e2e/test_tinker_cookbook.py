"""tinker-cookbook's own supervised loop, unmodified, against `grpo-jobs dev`: it runs in the cookbook's
environment (`make cookbook`) and talks to the service over HTTP, as a user's would. Its RL loop runs on
the production layout (tests/faults/test_tinker_sessions.py): one run of it is 90 CPU-s, and the embedded
default serves the same SDK calls (tests/e2e/test_tinker_sdk.py)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.cookbook.harness import output, recipe_env, recipe_metrics, start_recipe
from tests.e2e.conftest import start_dev


def run_recipe(script: str, steps: int, *, base: str, key: str, cookbook_python: Path, models_root: Path,
               tmp_path: Path, procs) -> list[dict]:
    """A script of tests/cookbook run against the service for `steps` steps: the cookbook's metrics."""
    log = tmp_path / script.removesuffix(".py")
    env = recipe_env(base=base, key=key, models_root=models_root, root=tmp_path)
    run = start_recipe(cookbook_python, script, log, steps, env)
    assert run.wait(timeout=900) == 0, output(log) + procs.logs()
    return recipe_metrics(log)


def test_the_cookbooks_supervised_loop_on_its_conversations(procs, models_root, cookbook_python, tmp_path):
    base, key = start_dev(procs)
    metrics = run_recipe("sl_conversations.py", 6, base=base, key=key, cookbook_python=cookbook_python,
                         models_root=models_root, tmp_path=tmp_path, procs=procs)
    nll = [m["train_mean_nll"] for m in metrics]
    assert len(nll) == 6 and nll[-1] < 0.6 * nll[0], nll  # the supervised loss falls
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        job = c.get("/v1/jobs", params={"kind": "session"}).json()["items"][0]
        assert job["step"] == 6
        series = c.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": "loss/total"}).json()["series"][0]
        assert [p["step"] for p in series["points"]] == [1, 2, 3, 4, 5, 6]
        listed = c.get(f"/api/v1/training_runs/{job['uid']}/checkpoints", headers={"X-API-Key": key}).json()
    # the cookbook's final save: a state, and weights to sample from, both named "final"
    assert sorted(ckpt["tinker_path"] for ckpt in listed["checkpoints"]) == [
        f"tinker://{job['uid']}/sampler_weights/final", f"tinker://{job['uid']}/weights/final"]
