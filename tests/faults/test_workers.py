"""Workers on PostgreSQL + Redis: many jobs per worker, killed workers, a broker and a store that
go away mid-job. Every job ends, with every step recorded once."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from service.store import keys as keys_q
from service.store.db import session_scope
from tests.e2e.conftest import parent_pid
from tests.faults.conftest import (
    LEASE_S,
    LONG_JOB,
    TcpProxy,
    assert_every_step_once,
    finished,
    job_state,
    reached_step,
    wait_for,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.faults]

SHORT_JOB = {**LONG_JOB, "grpo": {**LONG_JOB["grpo"], "steps": 3, "checkpoint_every": 0}}
# outlasts an outage of a few seconds
LONGER_JOB = {**LONG_JOB, "grpo": {**LONG_JOB["grpo"], "steps": 150, "checkpoint_every": 10}}


def _events(c, job_id) -> list[str]:
    return [e["type"] for e in c.get(f"/v1/jobs/{job_id}/events").json()]


def test_five_jobs_in_a_row_on_one_worker_all_succeed_and_a_tenant_sees_no_host(cluster, pg_url):
    """The fifth is a tenant's: its views of the workers and of its job (events, nodes, the live stream) name
    no host, process or port of the cluster, where the admin's key (the cluster's) sees them."""
    with session_scope(pg_url) as s:
        tenant = keys_q.create_key(s, owner="tenant")
    cluster.serve()
    cluster.worker(GRPO_NODE_NAME="machine-zq7")
    with cluster.client() as c, httpx.Client(base_url=cluster.base, timeout=30,
                                             headers={"Authorization": f"Bearer {tenant}"}) as t:
        ids = [c.post("/v1/jobs", json={**SHORT_JOB, "name": f"row-{i}"}).json()["id"] for i in range(4)]
        ids.append(t.post("/v1/jobs", json={**SHORT_JOB, "name": "row-4"}).json()["id"])
        for job_id in ids:
            job = finished(t if job_id == ids[-1] else c, job_id, cluster)
            assert job["status"] == "succeeded", (job, cluster.logs())
            assert_every_step_once(t if job_id == ids[-1] else c, job_id, 3)
        (seen,) = c.get("/v1/workers").json()["items"]
        holder = next(e for e in c.get(f"/v1/jobs/{ids[0]}/events").json() if e["type"] == "started")["data"]["holder"]
        assert seen["hostname"] == "machine-zq7" and holder.startswith(f"{socket.gethostname()}:")
        with t.stream("GET", f"/v1/jobs/{ids[-1]}/stream") as r:
            streamed = "".join(r.iter_text())  # the job has ended: the stream sends everything, then ends
        views = [t.get("/v1/workers").text, t.get(f"/v1/jobs/{ids[-1]}/events").text,
                 t.get(f"/v1/jobs/{ids[-1]}/nodes").text, t.get(f"/v1/jobs/{ids[-1]}").text, streamed]
    for view in views:
        assert "machine-zq7" not in view and holder not in view and seen["name"] not in view, view[:2000]
        assert '"holder"' not in view and '"hostname":"' not in view.replace(" ", ""), view[:2000]


def test_killed_worker_is_replaced_at_once_and_the_job_resumes(cluster):
    cluster.serve()
    cluster.worker("w1")
    with cluster.client() as c:
        job_id = c.post("/v1/jobs", json=LONG_JOB).json()["id"]
        reached_step(c, job_id, 5, cluster)
        cluster.kill_group("w1")  # kill -9 of the worker and its pool child, mid-job
        cluster.worker("w2")  # started at once: the old lease is still live
        job = finished(c, job_id, cluster)
        assert job["status"] == "succeeded" and job["attempt"] == 2, cluster.logs()
        assert_every_step_once(c, job_id, 40)
        types = _events(c, job_id)
        assert "requeued" in types and "resumed" in types


def test_a_live_worker_takes_over_from_a_killed_one(cluster):
    cluster.serve()
    cluster.worker("w1")
    cluster.worker("w2")
    with cluster.client() as c:
        job_id = c.post("/v1/jobs", json=LONG_JOB).json()["id"]
        reached_step(c, job_id, 5, cluster)
        holder = next(e for e in c.get(f"/v1/jobs/{job_id}/events").json() if e["type"] == "started")["data"]["holder"]
        running_on = next(n for n, p in cluster.procs.items() if n.startswith("w") and _pid_in(holder, p.pid))
        cluster.kill_group(running_on)  # no restart: the other worker's sweep must notice
        job = finished(c, job_id, cluster)
        assert job["status"] == "succeeded" and job["attempt"] == 2, cluster.logs()
        assert_every_step_once(c, job_id, 40)


def _pid_in(holder: str, main_pid: int) -> bool:
    """The holder names the pool child's pid; its parent is the worker's main process."""
    return parent_pid(int(holder.split(":")[1])) == main_pid


def test_a_stranded_job_can_be_cancelled(cluster):
    cluster.serve()
    cluster.worker("w1")
    with cluster.client() as c:
        job_id = c.post("/v1/jobs", json=LONG_JOB).json()["id"]
        reached_step(c, job_id, 3, cluster)
        assert len(c.get("/v1/workers").json()["items"]) == 1
        cluster.kill_group("w1")
        assert c.post(f"/v1/jobs/{job_id}/cancel").json()["cancel_requested"]  # its worker is gone
        time.sleep(LEASE_S + 1)  # once the lease has expired, a cancel takes effect at once
        assert job_state(c, job_id)["status"] == "running"  # no worker left to sweep it
        assert c.get("/v1/workers").json()["items"] == []  # nor listed: killed, it stopped saying it is alive
        assert c.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
        # and with a worker running, the sweep cancels a stranded job whose cancel was asked for
        other = c.post("/v1/jobs", json=LONG_JOB).json()["id"]
        cluster.worker("w2")
        reached_step(c, other, 3, cluster)
        cluster.kill_group("w2")
        assert c.post(f"/v1/jobs/{other}/cancel").json()["cancel_requested"]
        cluster.worker("w3")
        job = wait_for(lambda: (j := job_state(c, other))["status"] == "cancelled" and j, "the sweep to cancel",
                       cluster, timeout=60)
        assert job["step"] < 40 and _events(c, other)[-1] == "cancelled"


def test_a_broker_restart_mid_job_does_not_strand_it(cluster, redis_server):
    cluster.serve()
    cluster.worker()
    with cluster.client() as c:
        job_id = c.post("/v1/jobs", json=LONGER_JOB).json()["id"]
        reached_step(c, job_id, 3, cluster)
        redis_server.kill()
        time.sleep(3)
        redis_server.start()  # empty: the job's message is gone
        during = job_state(c, job_id)
        assert during["status"] == "running", "the outage should have come mid-job"
        job = finished(c, job_id, cluster)
        assert job["status"] == "succeeded", cluster.logs()
        assert job["attempt"] == 1  # the running job was never interrupted
        assert_every_step_once(c, job_id, 150)
        # and the worker takes new jobs afterwards
        again = c.post("/v1/jobs", json=SHORT_JOB).json()["id"]
        assert finished(c, again, cluster)["status"] == "succeeded"


def test_a_store_blip_shorter_than_the_lease_is_ridden_out(cluster, pg_url):
    proxy = TcpProxy(("127.0.0.1", 5432))
    proxy.start()
    via_proxy = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    cluster.serve()
    cluster.env["DATABASE_URL"] = via_proxy  # only the worker goes through the proxy
    cluster.worker()
    try:
        with cluster.client() as c:
            job_id = c.post("/v1/jobs", json=LONGER_JOB).json()["id"]
            reached_step(c, job_id, 3, cluster)
            proxy.cut()
            time.sleep(LEASE_S / 2)
            assert job_state(c, job_id)["status"] == "running"
            proxy.restore()
            job = finished(c, job_id, cluster)
            assert job["status"] == "succeeded" and job["attempt"] == 1, cluster.logs()
            assert_every_step_once(c, job_id, 150)
    finally:
        proxy.cut()


def test_a_store_outage_longer_than_the_lease_hands_the_job_to_the_sweep(cluster, pg_url):
    proxy = TcpProxy(("127.0.0.1", 5432))
    proxy.start()
    cluster.serve()
    cluster.worker("direct")  # this worker keeps its store
    time.sleep(2)  # let it take nothing yet: the cut-off worker must get the job
    cluster.kill_group("direct")
    cluster.worker("cut-off", DATABASE_URL=pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"))
    try:
        with cluster.client() as c:
            job_id = c.post("/v1/jobs", json=LONGER_JOB).json()["id"]
            reached_step(c, job_id, 3, cluster)
            proxy.cut()  # for good: the worker gives the lease up and stops training
            cluster.worker("direct")
            job = finished(c, job_id, cluster)
            assert job["status"] == "succeeded" and job["attempt"] == 2, cluster.logs()
            assert_every_step_once(c, job_id, 150)
            assert "requeued" in _events(c, job_id)
    finally:
        proxy.cut()
