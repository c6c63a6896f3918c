"""The nodes of a multi-node job's attempt, on SQLite and PostgreSQL: each node joins once, on a machine of its
own, and only the attempt (and the lease) that sent its message; an attempt given back before it started is
forgotten, so the next lease's nodes join afresh."""

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from service.core.specs import Status, parse_spec
from service.store import leases
from service.store import nodes as nodes_q
from service.store.db import session_scope
from service.store.migrate import upgrade
from service.store.models import Job, JobEvent, JobNode, utcnow

SPEC = {"kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
        "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 2}, "resources": {"nodes": 2}}


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    u = request.getfixturevalue("pg_url") if request.param == "postgres" else f"sqlite:///{tmp_path / 's.db'}"
    upgrade(u)
    return u


def _leased(url, holder="head"):
    job = leases.submit_job(url, owner="o", spec=parse_spec(SPEC)).job
    lease = leases.acquire_lease(url, job_id=job.id, holder=holder, lease_timeout_s=60)
    assert lease is not None and lease.attempt == 1
    return lease


def _join(url, lease, node, name, *, head="head", attempt=None, holder=None):
    return nodes_q.join(url, job_id=lease.job_id, uid=lease.uid, attempt=attempt or lease.attempt, head=head,
                        node=node, node_name=name, holder=holder or f"{name}:{node}")


def test_each_node_joins_once_on_a_machine_of_its_own(url):
    lease = _leased(url)
    joined = _join(url, lease, 0, "a", holder="head")
    assert not isinstance(joined, str) and joined.spec.resources.nodes == 2 and joined.owner == "o"
    assert _join(url, lease, 1, "a") == "same machine"  # a second worker of node 0's machine
    assert not isinstance(_join(url, lease, 1, "b"), str)
    assert _join(url, lease, 1, "c") == "taken"  # a redelivered message
    with session_scope(url) as s:
        assert [(n.node, n.node_name) for n in nodes_q.nodes_of(s, job_id=lease.job_id)] == [(0, "a"), (1, "b")]
        events = s.scalars(select(JobEvent).where(JobEvent.job_id == lease.job_id, JobEvent.type == "node")).all()
        assert [(e.data["node"], e.data["node_name"]) for e in events] == [(0, "a"), (1, "b")]
        assert events[1].message == "node 1 of 2 (attempt 1) taken by a worker"  # where: in its data


def test_a_message_of_another_attempt_or_lease_is_refused(url):
    lease = _leased(url)
    assert _join(url, lease, 1, "b", attempt=2) == "ended"
    assert _join(url, lease, 1, "b", head="someone else") == "ended"
    # given back before it started: not a failed attempt, and its nodes are forgotten
    assert leases.requeue(url, job_id=lease.job_id, holder="head", message="the others did not come", failed=False)
    assert _join(url, lease, 1, "b") == "ended"  # the job is queued: the old attempt's message is stale
    again = leases.acquire_lease(url, job_id=lease.job_id, holder="head-2", lease_timeout_s=60)
    assert again is not None and again.attempt == 1  # the same number: the first one never ran
    assert _join(url, lease, 1, "b") == "ended"  # sent by the first lease, whose endpoint is gone
    assert not isinstance(_join(url, again, 0, "a", head="head-2"), str)
    assert not isinstance(_join(url, again, 1, "b", head="head-2"), str)
    with session_scope(url) as s:
        assert s.get(Job, lease.job_id).attempt == 1
        waiting = s.scalars(select(JobEvent).where(JobEvent.job_id == lease.job_id, JobEvent.type == "waiting")).one()
        assert waiting.level == "warning" and waiting.message == "the others did not come"


def test_a_failed_attempts_nodes_stay_and_the_next_attempt_has_its_own(url):
    lease = _leased(url)
    assert not isinstance(_join(url, lease, 0, "a"), str) and not isinstance(_join(url, lease, 1, "b"), str)
    assert leases.requeue(url, job_id=lease.job_id, holder="head", message="a node was lost")
    again = leases.acquire_lease(url, job_id=lease.job_id, holder="head-2", lease_timeout_s=60)
    assert again.attempt == 2
    assert not isinstance(_join(url, again, 0, "b", head="head-2"), str)  # any machine may be node 0 now
    with session_scope(url) as s:
        assert [(n.attempt, n.node, n.node_name) for n in nodes_q.nodes_of(s, job_id=lease.job_id)] == [(2, 0, "b")]


def test_a_node_beats_while_its_attempt_runs_and_goes_silent_when_it_stops(url):
    lease = _leased(url)
    for node, name in ((0, "a"), (1, "b"), (2, "c")):
        assert not isinstance(_join(url, lease, node, name, holder=f"{name}:{node}"), str)
    with session_scope(url) as s:  # node 2 last beat a minute ago
        s.execute(update(JobNode).where(JobNode.node == 2).values(heartbeat_at=utcnow() - timedelta(seconds=60)))
    assert nodes_q.beat(url, job_id=lease.job_id, attempt=1, node=1, head="head")
    assert nodes_q.silent_nodes(url, job_id=lease.job_id, attempt=1, within_s=30) == [2]  # node 0 holds the lease
    assert nodes_q.silent_nodes(url, job_id=lease.job_id, attempt=1, within_s=120) == []
    assert leases.requeue(url, job_id=lease.job_id, holder="head", message="node 2 stopped answering")
    assert not nodes_q.beat(url, job_id=lease.job_id, attempt=1, node=1, head="head")  # over: node 1 stops its ranks


def test_a_node_that_joins_while_its_gang_is_given_back_is_forgotten_with_it(pg_url):
    """A give-back (the others did not come) and a late node's join at the same moment, on PostgreSQL: the join
    waits for the give-back's transaction and then finds the job queued, so no node of the gang that never ran
    stays in the attempt for the next lease's node 0 to take for a node that stopped answering."""
    upgrade(pg_url)
    lease = _leased(pg_url)
    assert not isinstance(_join(pg_url, lease, 0, "a", holder="head"), str)
    with ThreadPoolExecutor(1) as pool, session_scope(pg_url) as giving_back:
        # what leases.requeue(failed=False) does, held uncommitted while node 1's message is taken
        giving_back.execute(update(Job).where(Job.id == lease.job_id).values(status=Status.queued, lease_owner=None))
        nodes_q.forget_attempt(giving_back, job_id=lease.job_id, attempt=1)
        late = pool.submit(_join, pg_url, lease, 1, "b")
        time.sleep(0.5)
        assert not late.done()  # it waits on the job's row
    assert late.result(timeout=10) == "ended"
    with session_scope(pg_url) as s:
        assert s.scalars(select(JobNode).where(JobNode.job_id == lease.job_id)).all() == []
