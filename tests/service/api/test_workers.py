"""GET /v1/workers, and what a submitted job is told about where it can run; only the admin sees where workers
run."""

import pytest

from service.core.queue import worker_queues
from service.core.records import GpuInfo, WorkerInfo
from service.store import workers as workers_q

A100 = GpuInfo(index=0, name="NVIDIA A100-SXM4-40GB", memory_bytes=42_505_207_808)
JOB = {"kind": "grpo", "model": {"name": "tiny-random-llama"}, "grpo": {"steps": 1}}


def _register(api, name: str, gpus: int) -> None:
    workers_q.beat(api.settings.store_url, info=WorkerInfo(name=name, hostname="node-7", gpus=[A100] * gpus,
                                                           queues=worker_queues(gpus), concurrency=2))


def _waiting(api, job_id: int) -> list[dict]:
    return [e for e in api.get(f"/v1/jobs/{job_id}/events").json() if e["type"] == "waiting"]


@pytest.fixture
def admin_api(api):
    """alice is the admin (GRPO_ADMIN_OWNERS); bob a tenant."""
    api.settings.admin_owners_env = "alice"
    return api


def test_the_live_workers_are_listed_with_their_gpus_and_only_the_admin_sees_where(admin_api):
    api = admin_api
    assert api.get("/v1/workers").json() == {"items": []}
    assert api.client.get("/v1/workers").status_code == 401
    _register(api, "node-7:41:ab", 1)
    (w,) = api.get("/v1/workers", key=api.bob).json()["items"]  # every tenant sees what jobs can run on
    assert (w["name"], w["hostname"], w["queues"], w["concurrency"]) == (None, None, ["jobs", "gpu"], 2)
    assert w["gpus"] == [{"index": 0, "name": A100.name, "memory_bytes": A100.memory_bytes}]
    (w,) = api.get("/v1/workers").json()["items"]  # the admin also sees where
    assert (w["name"], w["hostname"]) == ("node-7:41:ab", "node-7")


def test_a_job_that_names_gpus_no_live_worker_has_is_queued_with_why(api):
    _register(api, "cpu-worker", 0)
    _register(api, "gpu-worker", 1)
    r = api.post("/v1/jobs", json={**JOB, "devices": {"policy": "cuda:1"}})  # needs a second GPU
    assert r.status_code == 201 and (r.json()["status"], r.json()["gpus"]) == ("queued", 2), r.text
    (waiting,) = _waiting(api, r.json()["id"])
    assert waiting["level"] == "warning" and waiting["data"] == {"gpus": 2, "queue": "gpu2"}
    assert "needs 2 GPU(s) on one worker" in waiting["message"] and "have 0, 1 GPU(s)" in waiting["message"]
    r = api.post("/v1/jobs", json={**JOB, "devices": {"policy": "cuda"}})  # the GPU worker can take this one
    assert r.json()["gpus"] == 1 and _waiting(api, r.json()["id"]) == []
    r = api.post("/v1/jobs", json=JOB)  # devices auto: any worker
    assert r.json()["gpus"] == 0 and _waiting(api, r.json()["id"]) == []


def test_a_jobs_nodes_say_which_worker_runs_each_and_only_to_its_owner(admin_api):
    api = admin_api
    from service.store import leases
    from service.store import nodes as nodes_q

    r = api.post("/v1/jobs", json={**JOB, "resources": {"nodes": 2}})
    assert r.status_code == 422 and "GRPO_MAX_NODES" in r.text  # this deployment runs jobs on one machine
    api.settings.max_nodes = 2
    job_id = api.post("/v1/jobs", json={**JOB, "resources": {"nodes": 2}}).json()["id"]
    assert api.get(f"/v1/jobs/{job_id}/nodes").json() == {"items": []}  # queued: no node yet
    lease = leases.acquire_lease(api.settings.store_url, job_id=job_id, holder="a:1:x", lease_timeout_s=60)
    for node, name in ((0, "a"), (1, "b")):
        nodes_q.join(api.settings.store_url, job_id=job_id, uid=lease.uid, attempt=1, head="a:1:x", node=node,
                     node_name=name, holder=f"{name}:{node + 1}:x")
    items = api.get(f"/v1/jobs/{job_id}/nodes").json()["items"]
    assert [(n["node"], n["attempt"], n["node_name"], n["holder"]) for n in items] == [(0, 1, "a", "a:1:x"),
                                                                                          (1, 1, "b", "b:2:x")]
    assert api.get(f"/v1/jobs/{job_id}/nodes", key=api.bob).status_code == 404  # another tenant's job
    # to a tenant, its own job's nodes and their events name no machine or process
    bobs = api.post("/v1/jobs", json={**JOB, "resources": {"nodes": 2}}, key=api.bob).json()["id"]
    lease = leases.acquire_lease(api.settings.store_url, job_id=bobs, holder="a:1:x", lease_timeout_s=60)
    nodes_q.join(api.settings.store_url, job_id=bobs, uid=lease.uid, attempt=1, head="a:1:x", node=0,
                 node_name="a", holder="a:1:x")
    (node,) = api.get(f"/v1/jobs/{bobs}/nodes", key=api.bob).json()["items"]
    assert (node["node"], node["node_name"], node["holder"]) == (0, None, None)
    (event,) = [e for e in api.get(f"/v1/jobs/{bobs}/events", key=api.bob).json() if e["type"] == "node"]
    assert event["data"] == {"node": 0, "attempt": 1} and "a:1:x" not in event["message"], event
    with api.client.stream("GET", f"/v1/jobs/{bobs}/stream", headers=api.auth(api.bob)) as r:  # the same live
        text = next(chunk for chunk in r.iter_text() if '"type": "node"' in chunk or '"type":"node"' in chunk)
    assert "a:1:x" not in text and '"node_name"' not in text, text
