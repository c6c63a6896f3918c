"""A real Celery worker process on the real Redis, the store on the real PostgreSQL."""

import os
import time
from pathlib import Path

import httpx
import pytest

from service.store import keys as keys_q
from service.store.db import session_scope
from service.store.migrate import upgrade
from tests.e2e.conftest import (
    SFT_JOB,
    TINY_JOB,
    VLLM_JOB,
    check_finished_job,
    check_finished_sft_job,
    check_still_waiting,
    free_port,
    submit_gpu_job,
    wait_http,
    wait_job,
)
from tests.otlp import Receiver
from tests.webhook_receiver import WebhookReceiver


@pytest.fixture
def service(procs, pg_url, redis_url):
    """Starts `grpo-jobs serve` and a separate `grpo-jobs worker` on PostgreSQL and Redis (with extra
    environment, if given) and gives a client holding a fresh owner's key, once /readyz answers."""
    import uuid

    clients: list[httpx.Client] = []

    def start(**env: str) -> httpx.Client:
        # Messages left in Redis by earlier runs name jobs of other databases: the worker drops
        # unknown ids, and the lease keeps a stray duplicate from running a job twice.
        procs.env.update(DATABASE_URL=pg_url, BROKER_URL=redis_url, **env)
        upgrade(pg_url)
        with session_scope(pg_url) as s:
            key = keys_q.create_key(s, owner=f"e2e-{uuid.uuid4().hex[:6]}")
        port = free_port()
        procs.start("api", "serve", "--port", str(port))
        procs.start("worker", "worker", "--loglevel", "INFO")
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/readyz", procs)  # 200 once `serve` has checked (and migrated) the store in the background
        clients.append(httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30))
        return clients[-1]

    yield start
    for c in clients:
        c.close()


@pytest.mark.redis
@pytest.mark.postgres
def test_job_over_http_on_redis_and_postgres_behind_two_api_processes(service, procs):
    otlp = Receiver()  # both processes export their spans to it, as to a collector
    hooks = WebhookReceiver(fail_first=1)  # the first delivery gets a 500 and is retried
    # two API processes behind the port (`serve --workers 2`): each migrates, delivers webhooks, answers
    c = service(OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint, GRPO_WEBHOOK_URLS=f"{hooks.base}/hooks",
                GRPO_API_WORKERS="2")
    # the port answers from either process, and each checks the store in the background: both say ready
    ready, deadline = 0, time.time() + 60
    while ready < 8 and time.time() < deadline:
        checks = c.get("/readyz").json()["checks"]
        ready = ready + 1 if checks == {"store": "ok", "broker": "ok", "artifacts": "ok"} else 0
        time.sleep(0.05)
    assert ready == 8, checks
    hook = c.post("/v1/webhooks", json={"url": f"{hooks.base}/hooks", "events": ["job.succeeded"]}).json()
    gpu_job = submit_gpu_job(c, procs)  # on this CPU worker's machine, it waits for a GPU worker
    r = c.post("/v1/jobs", json=TINY_JOB)
    assert r.status_code == 201, r.text
    job = wait_job(c, r.json()["id"], procs)
    check_finished_job(c, job)
    # the outcome, delivered by the worker's deliverer: refused once, retried after its backoff (5 s)
    assert hooks.wait_for("job.succeeded", job["id"]).signed_by(hook["secret"])
    time.sleep(2 * 1.0)  # two more rounds of both processes' deliverers: none sends it again
    hooks.close()
    assert [r.delivery_id for r in hooks.received].count(hooks.received[-1].delivery_id) == 2  # a 500, then once
    (delivery,) = c.get(f"/v1/webhooks/{hook['id']}/deliveries").json()
    assert (delivery["status"], delivery["attempts"], delivery["last_status"]) == ("delivered", 2, 200)
    deadline = time.time() + 30  # the API exports in batches, every few seconds
    while time.time() < deadline and not any(s.service == "grpo-jobs-api" for s in otlp.spans):
        time.sleep(0.5)
    otlp.close()
    assert any(s.service == "grpo-jobs-api" and s.name == "POST /v1/jobs" for s in otlp.spans), {s.name for s in otlp.spans}
    (attempt,) = [s for s in otlp.named("grpo_jobs.attempt") if s.attributes["grpo_jobs.job.id"] == job["id"]]
    assert attempt.service == "grpo-jobs-worker" and attempt.attributes["grpo_jobs.attempt"] == 1
    steps = [s for s in otlp.named("rl.loop") if s.parent_id == attempt.span_id]
    assert sorted(s.attributes["grpo_jobs.step"] for s in steps) == [1, 2, 3]
    r = c.post("/v1/jobs", json=SFT_JOB)  # a second job on the same worker, of another kind, as 2 processes
    assert r.status_code == 201, r.text
    check_finished_sft_job(c, wait_job(c, r.json()["id"], procs))
    check_still_waiting(c, gpu_job)
    (worker,) = [p for name, p in procs.procs if name == "worker"]
    worker.terminate()  # a warm shutdown: it leaves the registry at once
    worker.wait(timeout=60)
    assert c.get("/v1/workers").json()["items"] == []


def _engine_processes(data_dir) -> list[int]:
    """Processes whose command line names a vLLM server folder under `data_dir`."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{data_dir}/engines/" in cmd:
            found.append(int(pid))
    return found


MISMATCH_BOUND = 1e-3  # |engine - trainer| log-prob per token, fp32; measured up to 3.4e-5 on this model


def _series(c, job_id: int, keys: str) -> dict[str, dict[int, float]]:
    return {s["key"]: {p["step"]: p["value"] for p in s["points"]}
            for s in c.get(f"/v1/jobs/{job_id}/metrics", params={"keys": keys}).json()["series"]}


@pytest.mark.redis
@pytest.mark.postgres
@pytest.mark.vllm
def test_a_vllm_job_matches_the_hf_job_run_next_on_the_same_worker(service, procs, vllm_python):
    """serve + a separate worker on PostgreSQL and Redis: a job sampled by its own vLLM server a step
    ahead (max_staleness 1), whose mismatch and staleness the API serves; then the same job sampled by
    generate on the same worker, with no server left: both see the same weights the same way."""
    c = service(GRPO_VLLM_PYTHON=str(vllm_python))
    r = c.post("/v1/jobs", json=VLLM_JOB)
    assert r.status_code == 201, r.text
    job = wait_job(c, r.json()["id"], procs, timeout=400)
    assert job["status"] == "succeeded", (job, procs.logs())
    vllm = _series(c, job["id"], "mismatch/logp_abs_max,mismatch/ratio_p05,mismatch/ratio_p50,mismatch/ratio_p95,"
                   "correction/changed_fraction,time/sync_s,rollout/staleness,eval/accuracy")
    assert len(vllm["time/sync_s"]) == 2
    assert list(vllm["rollout/staleness"].values()) == [0.0, 1.0]  # step 2 was sampled while step 1 trained
    # step 1: the same weights, the engine's kernels alone (step 2's sampler was a step behind, by design)
    assert vllm["mismatch/logp_abs_max"][1] < MISMATCH_BOUND
    assert 0.99 < vllm["mismatch/ratio_p05"][1] <= vllm["mismatch/ratio_p50"][1] <= vllm["mismatch/ratio_p95"][1] < 1.01
    assert vllm["correction/changed_fraction"][1] == 0.0  # nothing near the cap of 2
    types = [e["type"] for e in c.get(f"/v1/jobs/{job['id']}/events").json()]
    assert "engine_started" in types and "engine_restarted" not in types and types[-1] == "succeeded"
    assert _engine_processes(procs.env["GRPO_DATA_DIR"]) == []  # the server ended with its job
    engines = Path(procs.env["GRPO_DATA_DIR"]) / "engines"
    assert [p.name for p in engines.glob("*/*")] == ["vllm.log"]  # and its copy of the weights
    r = c.post("/v1/jobs", json={**VLLM_JOB, "name": "e2e-hf", "rollout": {"engine": "hf"}})  # the same worker next
    assert r.status_code == 201, r.text
    hf_job = wait_job(c, r.json()["id"], procs, timeout=400)
    assert hf_job["status"] == "succeeded", (hf_job, procs.logs())
    hf = _series(c, hf_job["id"], "eval/accuracy,mismatch/logp_abs_max")
    # greedy evaluation of the same weights: the same answers from either engine
    assert vllm["eval/accuracy"][0] == hf["eval/accuracy"][0]
    assert abs(vllm["eval/accuracy"][2] - hf["eval/accuracy"][2]) <= 0.25, (vllm["eval/accuracy"], hf["eval/accuracy"])
    assert not hf.get("mismatch/logp_abs_max")  # generate samples with the trainer's own weights: nothing to measure
