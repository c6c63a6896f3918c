import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, select, update

from service.store import db, leases
from service.store import jobs as jobs_q
from service.store import metrics as metrics_q
from service.store.db import get_engine, get_sessionmaker, session_scope
from service.store.migrate import upgrade
from service.store.models import Base, Job, Metric


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    u = request.getfixturevalue("pg_url") if request.param == "postgres" else f"sqlite:///{tmp_path / 's.db'}"
    upgrade(u)
    return u


def test_migration_head_matches_models(url):
    with get_engine(url).connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models and migrations differ; write a migration: {diff}"


def _job(url, owner="o"):
    with session_scope(url) as s:
        job, _ = jobs_q.create_job(s, owner=owner, kind="grpo", spec={}, name=None, total_steps=3)
        return job.id


def test_metric_writes_are_upserts(url):
    jid = _job(url)
    with session_scope(url) as s:
        metrics_q.upsert_step(s, job_id=jid, step=1, values={"a": 1.0, "b": 2.0})
    with session_scope(url) as s:  # a resumed job re-reports step 1
        metrics_q.upsert_step(s, job_id=jid, step=1, values={"a": 3.0})
    with session_scope(url) as s:
        rows = sorted(metrics_q.latest(s, job_id=jid).items())
        assert s.scalar(select(func.count()).select_from(Metric)) == 2
    assert rows == [("a", {"step": 1, "value": 3.0}), ("b", {"step": 1, "value": 2.0})]


def test_lease_is_exclusive_and_taken_over_when_stale(url):
    jid = _job(url)
    assert leases.acquire_lease(url, job_id=jid, holder="w1", lease_timeout_s=60)
    assert not leases.acquire_lease(url, job_id=jid, holder="w2", lease_timeout_s=60)  # redelivery: no
    assert leases.heartbeat(url, job_id=jid, holder="w1", step=2) is False
    with session_scope(url) as s:  # w1 dies: its heartbeat goes stale
        s.execute(update(Job).where(Job.id == jid).values(
            heartbeat_at=datetime.now(UTC) - timedelta(seconds=120)))
    assert leases.acquire_lease(url, job_id=jid, holder="w2", lease_timeout_s=60)
    assert leases.heartbeat(url, job_id=jid, holder="w1") is None  # w1 learns it lost the lease
    assert not leases.finish_job(url, job_id=jid, holder="w1", status="succeeded", message="w1 done")
    assert leases.finish_job(url, job_id=jid, holder="w2", status="succeeded", message="w2 done")
    with session_scope(url) as s:
        job = jobs_q.get_job(s, job_id=jid)
        assert (job.status, job.attempt, job.step) == ("succeeded", 2, 2)
    assert not leases.acquire_lease(url, job_id=jid, holder="w3", lease_timeout_s=0)  # terminal


def test_idempotent_create(url):
    with session_scope(url) as s:
        a, created_a = jobs_q.create_job(s, owner="o", kind="grpo", spec={}, name=None, total_steps=1,
                                         idempotency_key="k")
        b, created_b = jobs_q.create_job(s, owner="o", kind="grpo", spec={}, name=None, total_steps=1,
                                         idempotency_key="k")
        assert a.id == b.id and created_a and not created_b
        assert s.scalar(select(func.count()).select_from(Job)) == 1


def test_threads_asking_at_once_share_one_pool(url, monkeypatch):
    """The API's first requests arrive on many threads at once: each must get the process's one pool, or the
    process holds a pool's connections per thread (20 pools for 20 threads before, 51 PostgreSQL connections
    for one API process in a tinker-cookbook run, with a pool of 30)."""
    fresh = url + ("?application_name=race" if url.startswith("postgres") else "-race")  # no engine for it yet
    start = threading.Barrier(20)
    create = db._create_engine

    def slow_create(u: str):  # as slow as a process's first, which imports the dialect: the threads overlap in it
        time.sleep(0.05)
        return create(u)

    monkeypatch.setattr(db, "_create_engine", slow_create)

    def pool_of(read_only: bool) -> int:
        start.wait()
        return id(get_sessionmaker(fresh, read_only).kw["bind"].pool)

    with ThreadPoolExecutor(20) as threads:
        pools = set(threads.map(pool_of, [i % 2 == 0 for i in range(20)]))
    assert pools == {id(get_engine(fresh).pool)}
    get_engine(fresh).dispose()
