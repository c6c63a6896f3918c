"""A real Celery worker process on the real Redis, the store on the real PostgreSQL."""

import os
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
    free_port,
    wait_http,
    wait_job,
)


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
def test_job_over_http_on_redis_and_postgres(service, procs):
    c = service()
    assert c.get("/readyz").json()["checks"] == {"store": "ok", "broker": "ok", "artifacts": "ok"}
    r = c.post("/v1/jobs", json=TINY_JOB)
    assert r.status_code == 201, r.text
    job = wait_job(c, r.json()["id"], procs)
    check_finished_job(c, job)
    r = c.post("/v1/jobs", json=SFT_JOB)  # a second job on the same worker, of another kind, as 2 processes
    assert r.status_code == 201, r.text
    check_finished_sft_job(c, wait_job(c, r.json()["id"], procs))


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


@pytest.mark.redis
@pytest.mark.postgres
@pytest.mark.vllm
def test_a_vllm_job_then_another_on_one_worker(service, procs, vllm_python):
    """serve + a separate worker on PostgreSQL and Redis: a job sampled by its own vLLM server a step
    ahead (max_staleness 1), whose mismatch and staleness the API serves, and after it another job on
    the same worker, with no server left."""
    c = service(GRPO_VLLM_PYTHON=str(vllm_python))
    r = c.post("/v1/jobs", json=VLLM_JOB)
    assert r.status_code == 201, r.text
    job = wait_job(c, r.json()["id"], procs, timeout=400)
    assert job["status"] == "succeeded", (job, procs.logs())
    series = {s["key"]: [p["value"] for p in s["points"]] for s in c.get(
        f"/v1/jobs/{job['id']}/metrics", params={"keys": "mismatch/logp_abs_max,time/sync_s,rollout/staleness"}
    ).json()["series"]}
    assert len(series["time/sync_s"]) == 2
    assert series["rollout/staleness"] == [0.0, 1.0]  # step 2 was sampled while step 1 trained
    assert series["mismatch/logp_abs_max"][0] < 1e-3  # step 1: the same weights, the engine's kernels alone
    types = [e["type"] for e in c.get(f"/v1/jobs/{job['id']}/events").json()]
    assert "engine_started" in types and types[-1] == "succeeded"
    assert _engine_processes(procs.env["GRPO_DATA_DIR"]) == []  # the server ended with its job
    engines = Path(procs.env["GRPO_DATA_DIR"]) / "engines"
    assert [p.name for p in engines.glob("*/*")] == ["vllm.log"]  # and its copy of the weights
    r = c.post("/v1/jobs", json=TINY_JOB)  # the same worker goes on with the next job
    assert r.status_code == 201, r.text
    check_finished_job(c, wait_job(c, r.json()["id"], procs))
