"""A session run's operation queue, on SQLite and PostgreSQL."""

import uuid

import pytest
from sqlalchemy import select

from service.core.records import OpResult, SampleRow, Samples
from service.core.specs import SessionJob, SessionSpec
from service.store import records
from service.store import session_ops as ops_q
from service.store.db import session_scope
from service.store.migrate import upgrade
from service.store.models import SessionOp


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    u = request.getfixturevalue("pg_url") if request.param == "postgres" else f"sqlite:///{tmp_path / 's.db'}"
    upgrade(u)
    return u


def _run_with_ops(url, kinds: list[str]) -> int:
    spec = SessionJob(session=SessionSpec(tinker_session="s1", model_id=uuid.uuid4().hex))
    with session_scope(url) as s:
        job = ops_q.create_run(s, owner="o", spec=spec)
        for seq, kind in enumerate(kinds):
            ops_q.add_op(s, job=job, kind=kind, body=kind.encode(), seq=seq)
        return job.id


def _row(completion: str) -> SampleRow:
    return SampleRow(index=0, prompt="1+1=", completion=completion, reward=None, advantage=None, extra={})


def test_next_run_takes_the_head_of_one_kind_in_order(url):
    job_id = _run_with_ops(url, ["sample", "sample", "sample", "optim_step", "sample"])
    run = ops_q.next_run(url, job_id=job_id, kind="sample", limit=8)
    assert [op.body for op in run] == [b"sample"] * 3  # not the one after optim_step: that would reorder
    assert len(ops_q.next_run(url, job_id=job_id, kind="sample", limit=2)) == 2
    assert ops_q.next_run(url, job_id=job_id, kind="optim_step", limit=8) == []


def test_complete_ops_records_results_and_samples_together(url):
    job_id = _run_with_ops(url, ["sample", "sample", "sample"])
    first, second, third = ops_q.next_run(url, job_id=job_id, kind="sample", limit=8)
    ops_q.fail_op(url, op_id=third.id, error="bad prompt", category="user")
    ops_q.complete_ops(url, results=[
        OpResult(first, b"r1", "proto", Samples(step=2, rows=[_row("2"), _row("3")])),
        OpResult(second, b"r2", "proto", Samples(step=2, rows=[_row("4")])),
        OpResult(third, b"r3", "proto", Samples(step=2, rows=[_row("5")])),  # failed already: left as it is
    ])
    with session_scope(url) as s:
        ops = {op.id: op for op in s.scalars(select(SessionOp).where(SessionOp.job_id == job_id))}
        assert (ops[first.id].status, ops[first.id].result) == ("done", b"r1")
        assert (ops[second.id].status, ops[second.id].result) == ("done", b"r2")
        assert (ops[third.id].status, ops[third.id].error, ops[third.id].result) == ("failed", "bad prompt", None)
        samples = records.list_samples(s, job_id=job_id, step=2)
        # a step's samples are numbered on across calls; the failed op's are not recorded
        assert [(x.index, x.completion) for x in samples] == [(0, "2"), (1, "3"), (2, "4")]
        assert all(x.reward is None for x in samples)
