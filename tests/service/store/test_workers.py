"""The worker registry, on SQLite and PostgreSQL: a worker is live while it says so, gone when it leaves or
stops saying so, and a job that needs GPUs no live worker has is told why it waits."""

from datetime import timedelta

import pytest
from sqlalchemy import update

from service.core.queue import worker_queues
from service.core.records import GpuInfo, WorkerInfo
from service.store import workers as workers_q
from service.store.db import session_scope
from service.store.migrate import upgrade
from service.store.models import Worker, utcnow

H100 = GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", memory_bytes=85_520_809_984)


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    u = request.getfixturevalue("pg_url") if request.param == "postgres" else f"sqlite:///{tmp_path / 's.db'}"
    upgrade(u)
    return u


def worker(name: str, gpus: int) -> WorkerInfo:
    return WorkerInfo(name=name, hostname="node-1", gpus=[H100] * gpus, queues=worker_queues(gpus), concurrency=1)


def _age(url: str, name: str, by: timedelta) -> None:
    with session_scope(url) as s:
        s.execute(update(Worker).where(Worker.name == name).values(seen_at=utcnow() - by))


def _live(url: str) -> list[str]:
    with session_scope(url) as s:
        return [w.name for w in workers_q.live_workers(s, within_s=120)]


def test_a_worker_is_live_while_it_beats_and_gone_when_it_leaves_or_stops(url):
    workers_q.beat(url, info=worker("cpu:1", 0))
    workers_q.beat(url, info=worker("gpu:2", 2))
    workers_q.beat(url, info=worker("gpu:2", 2))  # renewed, not written twice
    with session_scope(url) as s:
        (gpu,) = [w for w in workers_q.live_workers(s, within_s=120) if w.name == "gpu:2"]
        assert gpu.gpus == [{"index": 0, "name": H100.name, "memory_bytes": H100.memory_bytes}] * 2
        assert gpu.queues == ["jobs", "gpu", "gpu2"] and gpu.concurrency == 1
    assert _live(url) == ["cpu:1", "gpu:2"]
    _age(url, "cpu:1", timedelta(seconds=121))  # killed: it stopped beating
    assert _live(url) == ["gpu:2"]
    workers_q.beat(url, info=worker("cpu:1", 0))  # back (the store was away): live again, the same row
    assert _live(url) == ["cpu:1", "gpu:2"]
    workers_q.leave(url, name="gpu:2")
    assert _live(url) == ["cpu:1"]


def test_a_row_a_day_stale_is_forgotten_by_the_next_beat(url):
    workers_q.beat(url, info=worker("old", 0))
    _age(url, "old", timedelta(days=1, seconds=1))
    workers_q.beat(url, info=worker("new", 0))
    with session_scope(url) as s:
        assert [w.name for w in s.query(Worker)] == ["new"]


def test_a_job_is_told_why_it_waits_until_a_worker_has_its_gpus(url):
    def why(gpus: int) -> str | None:
        with session_scope(url) as s:
            return workers_q.why_waiting(s, gpus=gpus, within_s=120)

    assert "needs 1 GPU(s) on one worker" in why(1) and "no worker is live" in why(1)
    workers_q.beat(url, info=worker("cpu", 0))
    workers_q.beat(url, info=worker("one", 1))
    assert why(1) is None
    assert "the 2 live worker(s) have 0, 1 GPU(s)" in why(2) and "queue 'gpu2'" in why(2)
    workers_q.beat(url, info=worker("two", 2))
    assert why(2) is None
    _age(url, "two", timedelta(minutes=3))  # a worker that is gone serves nothing
    assert why(2) is not None
