"""The API when its store goes away, two stores on one data directory, and many open streams."""

from __future__ import annotations

import socket
import time

import pytest
from sqlalchemy import create_engine, text

from service.store.db import get_engine
from tests.conftest import Api
from tests.faults.conftest import LONG_JOB, TcpProxy, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.faults]
SHORT_JOB = {**LONG_JOB, "grpo": {**LONG_JOB["grpo"], "steps": 3, "checkpoint_every": 1}}


def _routes(openapi: dict) -> list[tuple[str, str]]:
    """Every documented /v1 operation, path parameters filled with 1."""
    out = []
    for path, ops in openapi["paths"].items():
        if path.startswith("/v1/"):
            concrete = "/".join("1" if p.startswith("{") else p for p in path.split("/"))
            out += [(method.upper(), concrete) for method in ops]
    return out


def test_store_unreachable_at_the_api_is_a_503_on_every_route(cluster, pg_url):
    proxy = TcpProxy(("127.0.0.1", 5432))
    # serve starts while the store is down, and answers 503 until it can migrate
    cluster.serve(ready=False, DATABASE_URL=pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"))
    with cluster.client(timeout=10) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["store"].startswith("unreachable")
        r = c.get("/v1/jobs")
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
        proxy.start()
        wait_for(lambda: c.get("/readyz").status_code == 200, "the API to migrate and get ready", cluster, timeout=60)
        assert c.get("/v1/jobs").status_code == 200
        routes = _routes(c.get("/openapi.json", timeout=60).json())  # built on first ask: seconds on a busy CPU
        assert len(routes) >= 10
        proxy.cut()
        for method, path in routes:
            body = SHORT_JOB if method == "POST" and path == "/v1/jobs" else None
            r = c.request(method, path, json=body)
            assert r.status_code == 503, (method, path, r.status_code, r.text)
            assert r.headers["retry-after"] and "store" in r.json()["detail"]
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").json()["checks"]["store"].startswith("unreachable")
        scrape = c.get("/metrics").text
        assert "grpo_store_up 0.0" in scrape and "grpo_jobs{" not in scrape  # no zeros that look real
        proxy.restore()
        wait_for(lambda: c.get("/v1/jobs").status_code == 200, "the API to reconnect", cluster, timeout=30)
        assert "grpo_store_up 1.0" in c.get("/metrics").text
    proxy.cut()


def test_two_stores_on_one_data_directory_never_share_checkpoints(settings_factory, pg_url_factory):
    first = Api(settings_factory(database_url=pg_url_factory()))
    second = Api(settings_factory(database_url=pg_url_factory()))  # same GRPO_DATA_DIR, ids from 1 again
    assert first.settings.artifacts_dir == second.settings.artifacts_dir
    a = first.run_job(SHORT_JOB)
    b = second.run_job(SHORT_JOB)
    assert a == b == 1
    uid_a, uid_b = (api.get(f"/v1/jobs/{a}").json()["uid"] for api in (first, second))
    assert uid_a != uid_b
    for api in (first, second):
        types = [e["type"] for e in api.get(f"/v1/jobs/{a}/events").json()]
        assert "resumed" not in types and types[-1] == "succeeded"  # each job 1 started fresh
        assert [c["step"] for c in api.get(f"/v1/jobs/{a}/checkpoints").json()] == [1, 2, 3]
    assert sorted(p.name for p in first.settings.artifacts_dir.iterdir()) == sorted([uid_a, uid_b])


def _open_stream(port: int, key: str, job_id: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"GET /v1/jobs/{job_id}/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
              "Accept: text/event-stream\r\n\r\n".encode())
    return s


def test_200_open_streams_leave_the_api_responsive_and_hold_no_connection(cluster, pg_url):
    cluster.serve()  # no worker: the jobs stay queued and their streams stay open
    port = int(cluster.base.rsplit(":", 1)[1])
    with cluster.client(timeout=10) as c:
        ids = [c.post("/v1/jobs", json={**SHORT_JOB, "name": f"s{i}"}).json()["id"] for i in range(20)]
        streams = [_open_stream(port, cluster.key, ids[i % len(ids)]) for i in range(200)]
        try:
            for s in streams:  # every stream is open and has sent its first status
                head = s.recv(65536).decode()
                while "event: status" not in head:
                    head += s.recv(65536).decode()
                assert head.startswith("HTTP/1.1 200")
            time.sleep(2)  # a few poll rounds
            for _ in range(20):
                r = c.get("/v1/jobs", params={"limit": 50})
                assert r.status_code == 200 and len(r.json()["items"]) == 20
            admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                states = conn.execute(text(
                    "SELECT state, count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() GROUP BY state")).all()
            admin.dispose()
            by_state = dict(states)
            assert by_state.get("idle in transaction", 0) == 0, by_state
            assert sum(by_state.values()) <= 12, by_state  # the API's pool, not a connection per stream
        finally:
            for s in streams:
                s.close()
    get_engine(pg_url).dispose()
