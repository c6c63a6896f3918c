import json
import time

from service.core.records import SampleRow, SelectionRecord, SparsityRecord
from service.core.sparsity import ChangeStats, SparsityReport
from service.store import events as events_q
from service.store import jobs as jobs_q
from service.store import leases, records
from service.store import metrics as metrics_q
from service.store.db import session_scope

GRPO = {"kind": "grpo", "grpo": {"steps": 3, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 8}}


def _submit(api, spec=GRPO, key=None, **kw):
    r = api.post("/v1/jobs", key=key, json=spec, **kw)
    assert r.status_code == 201, r.text
    return r.json()


def test_auth_required(api):
    assert api.client.get("/v1/jobs").status_code == 401
    r = api.client.get("/v1/jobs", headers={"Authorization": "Bearer gj_nope"})
    assert r.status_code == 401 and r.json()["detail"] == "invalid, revoked or expired API key"
    assert api.get("/v1/jobs").status_code == 200


def test_submit_get_and_tenant_isolation(api):
    job = _submit(api)
    assert job["status"] == "queued" and job["total_steps"] == 3 and job["owner"] == "alice"
    assert job["spec"]["grpo"]["num_generations"] == 4
    assert job["spec"]["grpo"]["temperature"] == 1.0  # defaults are filled in and stored
    assert api.get(f"/v1/jobs/{job['id']}").json()["id"] == job["id"]
    # bob cannot see, read or cancel alice's job
    for path in ("", "/events", "/metrics", "/metrics/latest", "/selections", "/sparsity", "/samples", "/checkpoints"):
        assert api.get(f"/v1/jobs/{job['id']}{path}", key=api.bob).status_code == 404
    assert api.post(f"/v1/jobs/{job['id']}/cancel", key=api.bob).status_code == 404
    assert api.get("/v1/jobs", key=api.bob).json()["items"] == []
    assert api.get("/v1/jobs/999999").status_code == 404


def test_idempotency_key_returns_the_same_job(api):
    a = api.post("/v1/jobs", json=GRPO, headers={"Idempotency-Key": "abc"})
    b = api.post("/v1/jobs", json=GRPO, headers={"Idempotency-Key": "abc"})
    assert a.json()["id"] == b.json()["id"]
    assert b.headers.get("Idempotent-Replayed") == "true"
    c = api.post("/v1/jobs", key=api.bob, json=GRPO, headers={"Idempotency-Key": "abc"})  # per owner
    assert c.json()["id"] != a.json()["id"]
    assert len(api.get("/v1/jobs").json()["items"]) == 1


def test_cursor_pagination_and_filters(api):
    ids = [_submit(api)["id"] for _ in range(5)]
    _submit(api, {**GRPO, "kind": "tracin", "model": {"lora": {"r": 4}}})
    seen, after = [], None
    while True:
        page = api.get("/v1/jobs", params={"limit": 2, "kind": "grpo", **({"after": after} if after else {})}).json()
        seen += [j["id"] for j in page["items"]]
        if not page["has_more"]:
            break
        after = page["next_after"]
    assert seen == sorted(ids, reverse=True)
    assert [j["kind"] for j in api.get("/v1/jobs", params={"kind": "tracin"}).json()["items"]] == ["tracin"]
    api.post(f"/v1/jobs/{ids[0]}/cancel")
    assert [j["id"] for j in api.get("/v1/jobs", params={"status": "cancelled"}).json()["items"]] == [ids[0]]
    assert api.get("/v1/jobs", params={"status": "bogus"}).status_code == 422


def test_validation_errors_name_the_field(api):
    r = api.post("/v1/jobs", json={"kind": "grpo", "grpo": {"num_generations": 1}})
    assert r.status_code == 422
    err = r.json()["detail"][0]
    assert err["field"] == "grpo.num_generations" and "greater than or equal to 2" in err["message"]
    r = api.post("/v1/jobs", json={"kind": "tracin"})
    assert r.status_code == 422 and "model.lora is required" in r.json()["message"]
    r = api.post("/v1/jobs", json={"kind": "nope"})
    assert r.status_code == 422 and "kind" in r.json()["message"]
    r = api.post("/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "JSON" in r.json()["message"]
    r = api.post("/v1/jobs", json={"kind": "grpo", "model": {"name": "no-such-model"}})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "model.name"


def test_body_too_large_is_413(api):
    big = {**GRPO, "name": "x" * 100, "grpo": {**GRPO["grpo"], "stop": ["y" * 2_000_000]}}
    r = api.post("/v1/jobs", content=json.dumps(big).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_cancel_queued_then_conflict(api):
    job = _submit(api)
    r = api.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.json()["status"] == "cancelled"
    assert api.post(f"/v1/jobs/{job['id']}/cancel").status_code == 409
    types = [e["type"] for e in api.get(f"/v1/jobs/{job['id']}/events").json()]
    assert types == ["created", "cancelled"]


def test_cancel_running_is_cooperative(api):
    job = _submit(api)
    assert leases.acquire_lease(api.settings.store_url, job_id=job["id"], holder="w1", lease_timeout_s=60)
    r = api.post(f"/v1/jobs/{job['id']}/cancel").json()
    assert r["status"] == "running" and r["cancel_requested"] is True
    assert leases.heartbeat(api.settings.store_url, job_id=job["id"], holder="w1") is True


def test_metrics_downsampled_with_spikes_visible(api):
    job = _submit(api)
    with session_scope(api.settings.store_url) as s:
        rows = [(job["id"], "loss/total", step, 1.0) for step in range(1, 5001)]
        rows[2345] = (job["id"], "loss/total", 2346, 99.0)  # one-step spike
        metrics_q.upsert_points(s, rows=rows)
        metrics_q.upsert_step(s, job_id=job["id"], step=7, values={"reward/mean": 0.5, "kl": float("nan")})
        metrics_q.upsert_step(s, job_id=job["id"], step=7, values={"reward/mean": 0.75})  # upsert
    body = api.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": "loss/total", "max_points": 100}).json()
    s = body["series"][0]
    assert s["downsampled"] and s["total_points"] == 5000 and len(s["points"]) <= 100
    assert max(p["max"] for p in s["points"]) == 99.0
    assert body["keys"] == ["loss/total", "reward/mean"]  # NaN was not stored
    window = api.get(f"/v1/jobs/{job['id']}/metrics",
                     params={"keys": "loss/total", "from_step": 10, "to_step": 19}).json()["series"][0]
    assert [p["step"] for p in window["points"]] == list(range(10, 20)) and not window["downsampled"]
    latest = api.get(f"/v1/jobs/{job['id']}/metrics/latest").json()
    assert latest["reward/mean"] == {"step": 7, "value": 0.75}
    assert latest["loss/total"]["step"] == 5000
    empty = api.get(f"/v1/jobs/{job['id']}/metrics", params={"from_step": 5, "to_step": 1}).json()  # an empty range
    assert empty["keys"] == ["loss/total", "reward/mean"] and all(s["points"] == [] for s in empty["series"])


_STATS = ChangeStats(numel=10, sparsity={"0.0": 0.9}, sparsity_rtol=0.9, mean_abs_change=0.1,
                     max_abs_change=float("nan"), mean_rel_change=0.2, sign_flip_ratio=0.0)
REPORT = SparsityReport(**_STATS.model_dump(), primary_threshold=0.0, sparsity_primary=0.9,
                        per_layer={"0": _STATS}, per_component={"q_proj": _STATS},
                        per_layer_component={"0": {"q_proj": 0.9}}, time_s=0.5)


def test_reports_round_trip(api):
    job = _submit(api)
    jid = job["id"]
    with session_scope(api.settings.store_url) as s:
        records.put_selection(s, job_id=jid, record=SelectionRecord(
            step=1, policy="positive", total=4, selected=2, ratio=0.5, mean_influence=0.1,
            min_influence=-1.0, max_influence=1.0, histogram={"edges": [-1, 0, 1], "counts": [2, 2]},
            scores=[(0, 1.0, True), (1, -1.0, False)]))
        records.put_sparsity(s, job_id=jid, record=SparsityRecord(
            step=2, from_step=0, scope="window", sparsity=0.9, report=REPORT))
        records.put_samples(s, job_id=jid, step=1, rows=[SampleRow(
            index=0, prompt="p", completion="c", reward=1.0, advantage=0.5)])
        records.put_checkpoint(s, job_id=jid, step=2, path="/x/step-2", format="peft-lora", size_bytes=10)
    sel = api.get(f"/v1/jobs/{jid}/selections").json()
    assert sel[0]["selected"] == 2 and sel[0]["scores"][0] == [0, 1.0, True]
    assert api.get(f"/v1/jobs/{jid}/selections", params={"scores": False}).json()[0]["scores"] is None
    sp = api.get(f"/v1/jobs/{jid}/sparsity").json()
    assert sp[0]["sparsity"] == 0.9
    assert api.get(f"/v1/jobs/{jid}/sparsity/{sp[0]['id']}").json()["report"] == json.loads(REPORT.model_dump_json())
    assert api.get(f"/v1/jobs/{jid}/sparsity/99999").status_code == 404
    assert api.get(f"/v1/jobs/{jid}/samples", params={"step": 1}).json()[0]["completion"] == "c"
    assert api.get(f"/v1/jobs/{jid}/checkpoints").json()[0]["format"] == "peft-lora"


def test_stream_sends_status_metrics_events_and_end(api):
    job = _submit(api)
    jid = job["id"]
    with session_scope(api.settings.store_url) as s:
        metrics_q.upsert_step(s, job_id=jid, step=1, values={"reward/mean": 0.25})
        metrics_q.upsert_step(s, job_id=jid, step=2, values={"reward/mean": 0.5})
    leases.finish_job(api.settings.store_url, job_id=jid, holder=None, status="succeeded", message="done")
    # a browser's EventSource: a stream token for this job, never the key, in the URL
    token = api.post(f"/v1/jobs/{jid}/stream-token").json()["token"]
    assert api.alice not in token
    with api.client.stream("GET", f"/v1/jobs/{jid}/stream", params={"access_token": token}) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    kinds = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("event:")]
    assert kinds[0] == "status" and kinds[-1] == "end"
    assert kinds.count("metrics") == 2 and "event" in kinds
    with api.client.stream("GET", f"/v1/jobs/{jid}/stream", headers=api.auth()) as r:  # or the header
        assert r.status_code == 200
    # the key itself is not accepted in a URL, nor the token anywhere else or for another job
    other = _submit(api)["id"]
    assert api.client.get(f"/v1/jobs/{jid}/stream", params={"access_token": api.alice}).status_code == 401
    assert api.client.get(f"/v1/jobs/{other}/stream", params={"access_token": token}).status_code == 401
    for credential in (token, api.alice):  # other routes take no credential in the URL at all
        r = api.client.get(f"/v1/jobs/{jid}", params={"access_token": credential})
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "query.access_token"
    assert api.post(f"/v1/jobs/{jid}/stream-token", key=api.bob).status_code == 404  # not bob's job


def test_a_stream_opened_late_sends_every_event_before_end(api):
    """A job that ended with more events than one read takes (200): the stream still sends them all, the
    outcome last, then `end` (a chatty job used to lose its outcome from the stream)."""
    jid = _submit(api)["id"]
    with session_scope(api.settings.store_url) as s:
        for i in range(450):
            events_q.add_event(s, job_id=jid, type="health", message=f"flag {i}", level="warning")
    leases.finish_job(api.settings.store_url, job_id=jid, holder=None, status="cancelled", message="stopped")
    with api.client.stream("GET", f"/v1/jobs/{jid}/stream", headers=api.auth()) as r:
        text = "".join(r.iter_text())
    lines = text.splitlines()
    events = [json.loads(lines[i + 1].split(":", 1)[1]) for i, line in enumerate(lines)
              if line.startswith("event:") and line.split(":", 1)[1].strip() == "event"]
    assert len(events) == 452 and events[-1]["type"] == "cancelled"  # created, 450 flags, the outcome
    assert [line for line in lines if line.startswith("event:")][-1] == "event: end"


def test_a_live_stream_sends_each_new_step_and_reads_the_store_only_when_the_job_changed(api, monkeypatch):
    """A stream of a job that is still running waits on the process's one poll (StreamHub): it sends a step
    written after it opened, then the end, and while the job does not move it reads nothing."""
    from service.api import stream

    reads: list[int] = []
    real = stream._read
    monkeypatch.setattr(stream, "_read", lambda *a: reads.append(a[2]) or real(*a))
    jid = _submit(api)["id"]
    hub = api.client.app.state.stream_hub
    with api.client.stream("GET", f"/v1/jobs/{jid}/stream", headers=api.auth()) as r:
        sent = _sse(r.iter_lines())
        assert next(sent)[0] == "status"
        polls = hub.polls
        time.sleep(4.5)  # the job stands still: the hub polls; its first look may wake the stream once
        assert hub.polls - polls >= 3 and len(reads) <= 2, (hub.polls - polls, reads)
        with session_scope(api.settings.store_url) as s:
            metrics_q.upsert_step(s, job_id=jid, step=1, values={"reward/mean": 0.25})
        assert next(data for kind, data in sent if kind == "metrics") == {"step": 1, "metrics": {"reward/mean": 0.25}}
        leases.finish_job(api.settings.store_url, job_id=jid, holder=None, status="succeeded", message="done")
        rest = [kind for kind, _ in sent]
    assert rest[-1] == "end" and "metrics" not in rest


def _sse(lines):
    """(event, data) of each server-sent event, as they arrive."""
    kind = None
    for line in lines:
        if line.startswith("event:"):
            kind = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and kind:
            yield kind, json.loads(line.split(":", 1)[1])


def test_health_ready_and_prometheus(api):
    assert api.client.get("/healthz").json() == {"status": "ok"}
    r = api.client.get("/readyz")
    assert r.status_code == 200 and r.json()["checks"] == {"store": "ok", "broker": "ok", "artifacts": "ok"}
    _submit(api)
    text = api.client.get("/metrics").text
    assert 'grpo_jobs{status="queued"} 1.0' in text
    assert "grpo_http_requests_total" in text


def test_readyz_reports_unreachable_broker(settings_factory):
    from tests.conftest import Api

    api = Api(settings_factory(broker_url="redis://127.0.0.1:1/0"))
    r = api.client.get("/readyz")
    assert r.status_code == 503 and r.json()["checks"]["broker"] == "unreachable"
    # a submit with the broker down fails visibly and keeps the record
    r = api.post("/v1/jobs", json=GRPO)
    assert r.status_code == 503
    job = api.get("/v1/jobs").json()["items"][0]
    assert job["status"] == "failed" and "enqueue" in job["error"]


def test_a_metrics_request_is_one_statement_whatever_the_number_of_keys(api):
    from sqlalchemy import event

    from service.store.db import get_engine

    job = _submit(api)
    with session_scope(api.settings.store_url) as s:
        metrics_q.upsert_points(s, rows=[(job["id"], f"k/{i}", step, float(step)) for i in range(23)
                                         for step in range(1, 31)])
    seen: list[str] = []

    def count(_conn, _cursor, statement, *_args):
        seen.append(statement)

    engine = get_engine(api.settings.store_url)
    event.listen(engine, "before_cursor_execute", count)
    try:
        for keys in (None, "k/3", ",".join(f"k/{i}" for i in range(2000))):
            seen.clear()
            r = api.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": keys} if keys else {})
            assert r.status_code == 200
            series = [q for q in seen if "FROM metrics" in q and "count(*)" not in q]  # besides the validator's
            assert len(series) == 1 and len([q for q in seen if "FROM metrics" in q]) == 2, seen
            body = r.json()
            assert len(body["keys"]) == 23
            wanted = body["series"] if keys != "k/3" else body["series"][:1]
            assert all(len(s["points"]) == 30 for s in wanted if s["key"].startswith("k/") and
                       int(s["key"][2:]) < 23)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert len(body["series"]) == 2000 and body["series"][1999]["points"] == []


def test_security_headers_and_a_metrics_token(settings_factory):
    from tests.conftest import Api

    api = Api(settings_factory(GRPO_METRICS_TOKEN="s3cret"))
    page = api.client.get("/")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    assert "frame-ancestors 'none'" in csp
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["referrer-policy"]
    assert "frame-ancestors 'none'" in api.get("/v1/jobs").headers["content-security-policy"]
    assert api.client.get("/metrics").status_code == 401
    assert api.client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert "grpo_store_up" in api.client.get("/metrics", headers={"Authorization": "Bearer s3cret"}).text


def test_stream_tokens_are_redacted_from_access_logs():
    import logging

    from service.api.security import RedactTokens

    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("1.2.3.4", "GET", "/v1/jobs/1/stream?from_step=2&access_token=gjs_abc.def", "1.1", 200),
                               None)
    RedactTokens().filter(record)
    assert "gjs_abc" not in record.getMessage() and "from_step=2" in record.getMessage()


def test_wrong_methods_and_unknown_query_parameters(api):
    jid = _submit(api)["id"]
    r = api.client.options("/v1/jobs", headers=api.auth())
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
    r = api.client.get(f"/v1/jobs/{jid}/cancel", headers=api.auth())
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = api.get("/v1/jobs", params={"limt": 5})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "query.limt"
    assert "unknown query parameter" in r.json()["message"]


def test_a_stored_spec_this_version_refuses_is_shown_as_stored(api):
    """JobOut.spec is the typed spec; a row written by another version still reads, never a 500."""
    jid = _submit(api)["id"]
    with session_scope(api.settings.store_url) as s:
        job = jobs_q.get_job(s, job_id=jid)
        job.spec = {**job.spec, "grpo": {**job.spec["grpo"], "retired_option": 1}}
    for r in (api.get(f"/v1/jobs/{jid}"), api.get("/v1/jobs")):
        assert r.status_code == 200, r.text
    assert api.get(f"/v1/jobs/{jid}").json()["spec"]["grpo"]["retired_option"] == 1
    assert api.delete(f"/v1/jobs/{jid}").status_code in (204, 409)  # the file and init_from checks read it too

