"""tinker-cookbook's own loops, unmodified, against `grpo-jobs dev`: they run in the cookbook's
environment (`make cookbook`) and talk to the service over HTTP, as a user's would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx

from tests.e2e.conftest import start_dev

HERE = Path(__file__).parent.parent / "cookbook"
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def hf_cache_with_smollm2(models_root: Path, root: Path) -> Path:
    """A Hugging Face cache holding the bundled SmolLM2's tokenizer under its hub name: the cookbook
    loads its tokenizer by that name, with no network."""
    from worker.models import smollm2_dir

    source = smollm2_dir(models_root)
    repo = root / "hub" / f"models--{HUB_NAME.replace('/', '--')}"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("local")
    return root


def run_recipe(script: str, steps: int, *, base: str, key: str, cookbook_python: Path, models_root: Path,
               tmp_path: Path, procs) -> list[dict]:
    """A script of tests/cookbook run against the service for `steps` steps: the cookbook's metrics,
    a dict a step."""
    log = tmp_path / script
    env = {**os.environ, "TINKER_BASE_URL": base, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0",
           "HF_HOME": str(hf_cache_with_smollm2(models_root, tmp_path / "hf")), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([str(cookbook_python), str(HERE / script), str(log), str(steps)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + procs.logs()
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


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


def test_the_cookbooks_rl_loop_on_its_arithmetic_environment(procs, models_root, cookbook_python, tmp_path):
    """3 steps of 8 problems x 4 answers. What SmolLM2-135M learns in that time is the format: to end
    its answer (<|im_end|> within 8 tokens), the 0.1 of the reward that is not correctness."""
    base, key = start_dev(procs)
    metrics = [m for m in run_recipe("rl_arithmetic.py", 3, base=base, key=key, cookbook_python=cookbook_python,
                                     models_root=models_root, tmp_path=tmp_path, procs=procs) if "env/all/format" in m]
    assert len(metrics) == 3
    fmt = [m["env/all/format"] for m in metrics]
    # measured: about 0.56 of the untrained model's answers end in time, 0.9 to 1.0 after one step
    assert sum(fmt[1:]) / 2 >= fmt[0] + 0.15, fmt
    # the sampler's log-probs are the trainer's: the cookbook measures the KL between them
    assert all(abs(m["optim/kl_sample_train_v1"]) < 1e-3 for m in metrics), metrics
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        job = c.get("/v1/jobs", params={"kind": "session"}).json()["items"][0]
        assert job["step"] == 3
        series = c.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": "loss/total,tokens"}).json()["series"]
        assert {s["key"]: s["total_points"] for s in series} == {"loss/total": 3, "tokens": 3}
