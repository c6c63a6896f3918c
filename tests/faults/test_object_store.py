"""The S3 artifact store goes away mid-job behind a TCP proxy: a short outage is waited out and
the job finishes with every checkpoint stored; a long one fails the job with a readable event."""

import time
import uuid

import pytest

from service.core.artifacts import newest_step, open_store
from service.core.settings import Settings
from tests.conftest import S3Server
from tests.faults.conftest import (
    LEASE_S,
    LONG_JOB,
    TcpProxy,
    assert_every_step_once,
    finished,
    job_state,
    reached_step,
)

pytestmark = pytest.mark.faults
JOB = {**LONG_JOB, "grpo": {**LONG_JOB["grpo"], "steps": 12, "checkpoint_every": 1}}


@pytest.fixture
def s3_behind_proxy(cluster):
    s3 = S3Server()
    proxy = TcpProxy(("127.0.0.1", s3.port))
    proxy.start()
    fields = s3.settings(f"faults-{uuid.uuid4().hex[:8]}")
    cluster.env.update(fields, GRPO_S3_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}")
    yield proxy, fields
    proxy.cut()
    s3.stop()


def _cut_at_step_2(cluster, proxy, *, retry_s: str):
    """serve + a worker that retries the store for `retry_s`; a job, and the store cut at its step 2."""
    cluster.serve()
    cluster.worker(GRPO_ARTIFACT_RETRY_S=retry_s)
    with cluster.client() as c:
        job_id = c.post("/v1/jobs", json=JOB).json()["id"]
        reached_step(c, job_id, 2, cluster)
    proxy.cut()
    return job_id


def test_a_short_object_store_outage_is_waited_out(cluster, s3_behind_proxy):
    proxy, fields = s3_behind_proxy
    job_id = _cut_at_step_2(cluster, proxy, retry_s="120")
    with cluster.client() as c:
        time.sleep(3 * LEASE_S)  # longer than the lease and than boto's own retries: the heartbeat keeps the job
        assert job_state(c, job_id)["status"] == "running"
        proxy.restore()
        job = finished(c, job_id, cluster)
        assert job["status"] == "succeeded" and job["attempt"] == 1, cluster.logs()
        assert_every_step_once(c, job_id, 12)
        warned = [e for e in c.get(f"/v1/jobs/{job_id}/events").json() if e["type"] == "warning"]
        assert warned and "could not write" in warned[0]["message"], cluster.logs()
        assert [ck["step"] for ck in c.get(f"/v1/jobs/{job_id}/checkpoints").json()] == list(range(1, 13))
    store = open_store(Settings(**fields))
    assert newest_step(store.list(f"{job['uid']}/checkpoints")) == 12


def test_a_long_object_store_outage_fails_the_job_readably(cluster, s3_behind_proxy):
    proxy, _ = s3_behind_proxy
    job_id = _cut_at_step_2(cluster, proxy, retry_s="5")
    with cluster.client() as c:
        job = finished(c, job_id, cluster, timeout=120)
        assert job["status"] == "failed", cluster.logs()
        assert job["error"].startswith("ArtifactStoreError: the artifact store (s3://") and "could not" in job["error"]
        assert job["step"] >= 2  # what was recorded before stays
        assert len(c.get(f"/v1/jobs/{job_id}/metrics", params={"keys": "reward/mean"}).json()["series"][0]["points"]) >= 2
