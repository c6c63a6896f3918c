"""Real processes: `grpo-jobs serve`/`worker`/`dev` started as a user would, talked to over HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port  # noqa: F401 (imported from here by the e2e and fault tests)

BIN = Path(sys.executable).parent / "grpo-jobs"

TINY_JOB = {"kind": "grpo", "name": "e2e",
            "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
            "dataset": {"name": "arith", "num_train": 40, "num_val": 4},
            "grpo": {"steps": 3, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 8,
                     "eval_prompts": 2, "checkpoint_every": 2}}


# the same task fine-tuned with supervision, as two processes (each takes half of a step's examples)
SFT_JOB = {"kind": "sft", "name": "e2e-sft", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
           "dataset": {"name": "arith", "num_train": 40, "num_val": 8}, "resources": {"processes": 2},
           "sft": {"steps": 3, "batch_size": 4, "micro_batch_size": 2, "max_new_tokens": 8, "eval_prompts": 4,
                   "learning_rate": 1e-2, "checkpoint_every": 2}, "sparsity": {"measure_interval": 3}}

# rollouts from a vLLM server of the job's own (GRPO_VLLM_PYTHON): the bundled model, whose head size
# vLLM's CPU attention supports (the tiny models' 16 it does not)
# sampled by its own vLLM server a step ahead; the same spec with `rollout.engine: hf` is its reference
VLLM_JOB = {"kind": "grpo", "name": "e2e-vllm", "model": {"name": "smollm2-135m-instruct", "dtype": "float32", "lora": {"r": 8}},
            "dataset": {"name": "arith", "difficulty": 0}, "rollout": {"engine": "vllm", "max_staleness": 1},
            "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 12, "temperature": 0.8,
                     "learning_rate": 3e-4, "eval_prompts": 8, "epochs_per_rollout_batch": 2, "loss": "cispo",
                     "clip_eps_high": 2.0}}


class Procs:
    def __init__(self, env: dict, log_dir: Path) -> None:
        self.env, self.log_dir, self.procs = env, log_dir, []

    def start(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        """`grpo-jobs ARGS`, with `env` on top of the shared environment."""
        log = (self.log_dir / f"{name}.log").open("w")
        p = subprocess.Popen([str(BIN), *args], env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((name, p))
        return p

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{(self.log_dir / f'{n}.log').read_text()[-3000:]}" for n, _ in self.procs)

    def stop(self) -> None:
        for _, p in self.procs:
            p.terminate()
        for _, p in self.procs:
            try:
                p.wait(timeout=40)  # longer than `dev` takes to stop its worker
            except subprocess.TimeoutExpired:
                p.kill()


def run_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """The whole environment of a `grpo-jobs run` a test starts: a plain PATH, its data directory, and this
    test process's share of the cores (tests/conftest.py). torch's default, every core, would have two runs
    at once on two cores spin against each other; one thread runs an example faster than two here."""
    return {"PATH": "/usr/bin:/bin", "GRPO_DATA_DIR": str(data_dir),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra}


def embedded_env(data_dir: Path, models_root: Path) -> dict:
    """The environment of `grpo-jobs` processes on the embedded defaults (SQLite store and broker in
    `data_dir`), whatever DATABASE_URL or BROKER_URL the test run has."""
    env = {**os.environ, "GRPO_DATA_DIR": str(data_dir), "GRPO_MODELS_ROOT": str(models_root),
           "GRPO_HEARTBEAT_S": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("DATABASE_URL", None)
    env.pop("BROKER_URL", None)
    return env


@pytest.fixture
def procs(tmp_path, models_root):
    p = Procs(embedded_env(tmp_path / "data", models_root), tmp_path)
    yield p
    p.stop()


def parent_pid(pid: int) -> int | None:
    """A process's parent from /proc (None once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def wait_http(url: str, procs: Procs, timeout: float = 60) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} never came up\n{procs.logs()}")


def wait_job(client: httpx.Client, job_id: int, procs: Procs, timeout: float = 300) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not finish in {timeout}s\n{procs.logs()}")


def check_finished_job(client: httpx.Client, job: dict) -> None:
    assert job["status"] == "succeeded", job
    jid = job["id"]
    metrics = client.get(f"/v1/jobs/{jid}/metrics", params={"keys": "reward/mean,loss/total"}).json()
    assert [len(s["points"]) for s in metrics["series"]] == [3, 3]
    types = [e["type"] for e in client.get(f"/v1/jobs/{jid}/events").json()]
    assert types[:2] == ["created", "started"] and types[-1] == "succeeded"
    ckpts = client.get(f"/v1/jobs/{jid}/checkpoints").json()
    assert [c["step"] for c in ckpts] == [2, 3]
    assert all(c["format"] == "peft-lora" and c["size_bytes"] > 0 and "path" not in c for c in ckpts)
    assert client.get(f"/v1/jobs/{jid}/samples").json()
    detail = client.get(f"/v1/jobs/{jid}").json()
    fp = detail["fingerprint"]  # what ran, recorded by the worker
    assert len(fp["spec_sha256"]) == len(fp["data_sha256"]) == len(fp["model_sha256"]) == len(fp["trainable_sha256"]) == 64
    assert {"python", "torch", "transformers", "peft"} <= set(fp["libraries"]) and fp["hardware"]["cores"] >= 1
    assert fp["seeds"] == {"train": 0, "dataset": 0} and fp["processes"] == job["spec"]["resources"]["processes"]
    # no devices section: devices.policy 'auto', placed by this GPU-less worker on its CPU
    assert job["spec"]["devices"]["policy"] == "auto" and (fp["hardware"]["gpus"], fp["hardware"]["device"]) == ([], "cpu")
    # a random model never solves a sum: every group tied, and the job says so at its first step
    health = detail["health"]
    assert health["level"] == "critical", health
    tied = health["guards"]["informative_groups"]
    assert (tied["level"], tied["step"], tied["value"]) == ("critical", 1, 0.0) and "informative_groups" in tied["message"]
    assert health["guards"]["non_finite"] is None
    flagged = [e for e in client.get(f"/v1/jobs/{jid}/events").json() if e["type"] == "health"]
    assert flagged and {e["level"] for e in flagged} <= {"info", "warning", "error"}


def submit_gpu_job(client: httpx.Client, procs: Procs) -> int:
    """Once the one CPU worker is in the registry: a job whose devices name a GPU is queued on the `gpu` queue
    with an event saying why it waits; the caller checks later that no worker ran it (`check_still_waiting`)."""
    deadline = time.time() + 60
    while not (workers := client.get("/v1/workers").json()["items"]) and time.time() < deadline:
        time.sleep(0.5)  # the worker says it is alive once it is ready
    assert len(workers) == 1, (workers, procs.logs())
    assert workers[0]["gpus"] == [] and workers[0]["queues"] == ["jobs"], workers
    r = client.post("/v1/jobs", json={**TINY_JOB, "devices": {"policy": "cuda"}})
    assert r.status_code == 201 and r.json()["gpus"] == 1, r.text
    (waiting,) = [e for e in client.get(f"/v1/jobs/{r.json()['id']}/events").json() if e["type"] == "waiting"]
    assert waiting["data"] == {"gpus": 1, "queue": "gpu"}, waiting
    assert "the 1 live worker(s) have 0 GPU(s)" in waiting["message"], waiting
    return r.json()["id"]


def check_still_waiting(client: httpx.Client, job_id: int) -> None:
    """The job that needs a GPU was never taken by the CPU worker, which ran the jobs submitted after it."""
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert (job["status"], job["attempt"], job["started_at"]) == ("queued", 0, None), job


def check_finished_sft_job(client: httpx.Client, job: dict) -> None:
    """SFT_JOB, finished: its losses every step, evaluations at the start and the end, checkpoints and a
    sparsity report with KL on the task."""
    assert job["status"] == "succeeded", job
    jid = job["id"]
    series = {s["key"]: [p["step"] for p in s["points"]] for s in client.get(
        f"/v1/jobs/{jid}/metrics", params={"keys": "loss/train,loss/val,eval/token_accuracy"}).json()["series"]}
    assert series == {"loss/train": [1, 2, 3], "loss/val": [0, 3], "eval/token_accuracy": [0, 3]}
    assert [c["step"] for c in client.get(f"/v1/jobs/{jid}/checkpoints").json()] == [2, 3]
    report = client.get(f"/v1/jobs/{jid}/sparsity", params={"scope": "cumulative"}).json()[0]["report"]
    assert report["kl_task"] > 0 and set(report["merged"]["precision"]["bf16"]) == {"0.0", "1e-05", "0.0001"}


def start_dev(procs: Procs, **env: str) -> tuple[str, str]:
    """`grpo-jobs dev` on a free port (with `env` on top): its base URL and the API key it saved."""
    port = free_port()
    procs.start("dev", "dev", "--port", str(port), env=env)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/healthz", procs)
    key_file = Path(procs.env["GRPO_DATA_DIR"]) / "dev-api-key"
    for _ in range(100):
        if key_file.exists() and key_file.read_text().strip():
            break
        time.sleep(0.1)
    return base, key_file.read_text().strip()
