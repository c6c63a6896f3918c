"""The tinker-compatible routes' edges, over HTTP on the embedded store and on PostgreSQL: an operation is
stored once whatever the broker does, and every future ends (the SDK drives the same routes in
tests/e2e/test_tinker_sdk.py and, through a real broker outage, tests/faults/test_tinker_sessions.py)."""

import pytest
from sqlalchemy import func, select

from service.core.queue import Message
from service.store import session_ops
from service.store.db import session_scope
from service.store.models import Job, JobEvent, SessionOp, utcnow
from tests.conftest import Api, free_port

MODEL = {"base_model": "tiny-random-llama", "lora_config": {"rank": 4, "seed": 0}}
STEP = {"adam_params": {"learning_rate": 0.01}}


@pytest.fixture(params=["sqlite", "postgres"])
def down(request, settings_factory):
    """An API whose broker does not answer (nothing listens on its port)."""
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    return Api(settings_factory(database_url=url, broker_url=f"redis://127.0.0.1:{free_port()}/0"))


def _counts(api) -> tuple[int, int]:
    with session_scope(api.settings.store_url) as s:
        return (s.scalar(select(func.count()).select_from(Job).where(Job.kind == "session")),
                s.scalar(select(func.count()).select_from(SessionOp)))


def _run(api, session_id: str) -> dict:
    r = api.post("/api/v1/create_model", json={"session_id": session_id, **MODEL})
    assert r.status_code == 200, r.text
    return r.json()


def test_with_the_broker_down_an_operation_is_stored_once_and_delivered_by_the_sweep(down):
    session_id = down.post("/api/v1/create_session", json={}).json()["session_id"]
    future = _run(down, session_id)  # answered, not a 5xx: the SDK would retry a 5xx into a second run
    assert _counts(down) == (1, 1)
    r = down.post("/api/v1/optim_step", json={"model_id": future["model_id"], **STEP})
    assert r.status_code == 200, r.text
    assert _counts(down) == (1, 2)  # one run, two operations: nothing stored twice
    with session_scope(down.settings.store_url) as s:
        job = s.scalars(select(Job)).one()
        assert job.status == "idle"  # not queued without a message: the sweep wakes it
        assert [e.message for e in s.scalars(select(JobEvent).where(JobEvent.type == "idle"))][0].startswith(
            "not queued: the broker was unreachable")
    woken = session_ops.wake_stranded(down.settings.store_url, older_than_s=0)  # the broker is back
    assert woken == [Message(job.id, job.uid, 0)]  # queued for the sweep to enqueue, its operations pending


def test_a_cancelled_run_fails_its_futures_and_refuses_new_operations(api):
    session_id = api.post("/api/v1/create_session", json={}).json()["session_id"]
    future = _run(api, session_id)
    job = api.get("/v1/jobs", params={"kind": "session"}).json()["items"][0]
    assert job["status"] == "queued"
    assert api.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    ended = api.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).json()
    assert ended == {"error": "the run was cancelled before it started", "category": "user"}
    # not a 409, which the SDK retries for five minutes: a future that has already failed, naming the state
    r = api.post("/api/v1/optim_step", json={"model_id": future["model_id"], **STEP})
    assert r.status_code == 200, r.text
    refused = api.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}).json()
    assert refused == {"error": f"model {future['model_id']} has ended (cancelled): start a new training client",
                       "category": "user"}
    with session_scope(api.settings.store_url) as s:  # stored failed, with no body: nothing will run it
        assert [(op.status, op.body) for op in s.scalars(select(SessionOp).where(SessionOp.kind == "optim_step"))] \
            == [("failed", b"")]


def test_a_cancel_of_a_running_run_fails_its_queue_at_once_and_no_worker_starts_one_after(api):
    session_id = api.post("/api/v1/create_session", json={}).json()["session_id"]
    future = _run(api, session_id)
    with session_scope(api.settings.store_url) as s:  # a worker holds it
        job = s.scalars(select(Job)).one()
        job.status, job.lease_owner, job.heartbeat_at, job_id = "running", "w1", utcnow(), job.id
    queued = api.post("/api/v1/optim_step", json={"model_id": future["model_id"], **STEP}).json()
    assert api.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "running"  # its worker ends it
    for request_id in (future["request_id"], queued["request_id"]):
        failed = api.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        assert failed == {"error": "the run was cancelled", "category": "user"}
    r = api.post("/api/v1/optim_step", json={"model_id": future["model_id"], **STEP})
    refused = api.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}).json()
    assert refused["error"] == f"model {future['model_id']} was cancelled: start a new training client"
    with session_scope(api.settings.store_url) as s:  # one stored in the instant before the cancel: not started
        session_ops.add_op(s, job=s.get(Job, job_id), kind="optim_step", body=b"{}")
    assert session_ops.next_op(api.settings.store_url, job_id=job_id) is None
    assert session_ops.next_run(api.settings.store_url, job_id=job_id, kind="optim_step", limit=4) == []


def test_a_pending_operation_of_a_run_that_ended_is_failed_by_the_sweep(api):
    """The instant between a route's status check and its commit: the sweep's safety net."""
    session_id = api.post("/api/v1/create_session", json={}).json()["session_id"]
    future = _run(api, session_id)
    with session_scope(api.settings.store_url) as s:  # ended without the transition failing its futures
        s.scalars(select(Job)).one().status = "failed"
    assert session_ops.fail_orphaned(api.settings.store_url) == 1
    ended = api.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).json()
    assert ended == {"error": "the run has ended (failed)", "category": "server"}


def test_bad_input_is_a_4xx_naming_the_field(api):
    session_id = api.post("/api/v1/create_session", json={}).json()["session_id"]
    lora = {"rank": 1, "seed": 0, "train_unembed": True, "train_mlp": True, "train_attn": 0}
    r = api.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": 0.0, "base_model": "",
                                               "lora_config": lora, "user_metadata": None})  # found by schemathesis
    assert r.status_code == 400 and r.json()["detail"][0]["field"] == "base_model"
    nothing = {"rank": 4, "train_unembed": False, "train_mlp": False, "train_attn": False}
    r = api.post("/api/v1/create_model", json={"session_id": session_id, "base_model": "tiny-random-llama",
                                               "lora_config": nothing})
    assert r.status_code == 400 and r.json()["detail"][0]["field"] == "lora_config"
    r = api.post("/api/v1/forward_backward", content=iter([b"\0" * 2**20] * 9),  # chunked: no Content-Length
                 headers={"content-type": "application/x-protobuf"})
    assert r.status_code == 413, r.text
    assert _counts(api) == (0, 0)


def test_a_sample_request_past_the_servers_budget_is_refused(settings_factory):
    api = Api(settings_factory(GRPO_SAMPLE_REQUEST_TOKENS=1000))
    ask = {"sampling_session_id": "nope:v0", "prompt": {"chunks": [{"tokens": list(range(90))}]},
           "sampling_params": {"max_tokens": 10}}
    r = api.post("/api/v1/asample", json={**ask, "num_samples": 11})  # 11 x (90 + 10) = 1100 positions
    assert r.status_code == 400 and r.json()["detail"][0]["field"] == "num_samples", r.text
    assert "GRPO_SAMPLE_REQUEST_TOKENS" in r.json()["detail"][0]["message"]
    assert api.post("/api/v1/asample", json={**ask, "num_samples": 10}).status_code == 404  # within: no such sampler


def test_a_retried_operation_is_the_same_future_stored_once(api):
    """The SDK sends a request again when its answer was lost (a timeout, a reset connection): the same seq,
    kind and body are the same call, answered with the future already stored."""
    session_id = api.post("/api/v1/create_session", json={}).json()["session_id"]
    model_id = _run(api, session_id)["model_id"]
    step = {"model_id": model_id, "seq_id": 3, **STEP}
    first = api.post("/api/v1/optim_step", json=step).json()
    before = _counts(api)
    assert api.post("/api/v1/optim_step", json=step).json()["request_id"] == first["request_id"]
    assert _counts(api) == before
    other = api.post("/api/v1/optim_step", json={**step, "seq_id": 4}).json()  # the next call: its own
    assert other["request_id"] != first["request_id"] and _counts(api) == (before[0], before[1] + 1)
