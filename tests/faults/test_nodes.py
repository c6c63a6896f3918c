"""A job on two machines, on the production layout: `grpo-jobs serve` and a `grpo-jobs worker` per node, each told
it is another machine (GRPO_NODE_NAME) and reaching the others on loopback, on PostgreSQL and a Redis of the
test's own. The job starts once two workers have each taken a node of it, trains to the metrics of one worker
running two processes, and survives losing either node."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from tests.e2e.conftest import free_port, parent_pid
from tests.faults.conftest import LONG_JOB, assert_every_step_once, finished, job_state, reached_step, wait_for
from tests.metrics import MEASURED

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.faults]

GANG_WAIT_S = 4
# float64: the two layouts' ranks use different thread counts, whose float32 rounding would pass for a difference
EQUAL_JOB = {**LONG_JOB, "model": {**LONG_JOB["model"], "dtype": "float64"},
             "grpo": {**LONG_JOB["grpo"], "steps": 3, "checkpoint_every": 0, "samples_per_step": 4}}
TWO_NODES = {**EQUAL_JOB, "name": "two-nodes", "resources": {"nodes": 2}}
ONE_NODE = {**EQUAL_JOB, "name": "one-node-two-processes", "resources": {"processes": 2}}


@pytest.fixture
def nodes(cluster):
    """The cluster's processes may run jobs on two nodes, which meet on a port of the test's own."""
    port = free_port()
    cluster.env.update(GRPO_MAX_NODES="2", GRPO_NODE_ADDRESS="127.0.0.1", GRPO_GANG_WAIT_S=str(GANG_WAIT_S),
                       GRPO_RENDEZVOUS_PORTS=f"{port}-{port}")
    cluster.rendezvous_port = port
    return cluster


def _events(c, job_id, kind=None) -> list[dict]:
    return [e for e in c.get(f"/v1/jobs/{job_id}/events").json() if kind is None or e["type"] == kind]


def _waiting(c, job_id, saying: str) -> list[dict]:
    return [e for e in _events(c, job_id, "waiting") if saying in e["message"]]


def _metrics(c, job_id) -> dict[str, list[tuple[int, float]]]:
    series = c.get(f"/v1/jobs/{job_id}/metrics").json()["series"]
    return {s["key"]: [(p["step"], p["value"]) for p in s["points"]] for s in series
            if not s["key"].startswith(MEASURED)}


def test_a_two_node_job_waits_for_its_second_node_then_trains_as_one_node_with_two_processes(nodes):
    nodes.serve()
    nodes.worker("a", GRPO_NODE_NAME="a")
    with nodes.client() as c:
        r = c.post("/v1/jobs", json={**TWO_NODES, "resources": {"nodes": 4},
                                      "grpo": {**TWO_NODES["grpo"], "prompts_per_step": 4}})
        assert r.status_code == 422 and "GRPO_MAX_NODES" in r.text, r.text  # the admin's limit, at submit time
        # one machine: the lone worker takes no node of it, says why at once, and keeps taking single-node jobs
        lone = c.post("/v1/jobs", json=TWO_NODES).json()["id"]
        waiting = wait_for(lambda: _waiting(c, lone, "1 machine(s) have a live worker"), "a waiting event", nodes,
                           timeout=60)[0]
        assert "waiting for 2 workers on different machines" in waiting["message"], waiting
        single = c.post("/v1/jobs", json={**EQUAL_JOB, "name": "meanwhile"}).json()["id"]
        assert finished(c, single, nodes)["status"] == "succeeded", nodes.logs()
        assert c.post(f"/v1/jobs/{lone}/cancel").status_code == 200
        assert wait_for(lambda: job_state(c, lone)["status"] == "cancelled", "the cancel", nodes, timeout=5)
        assert not _events(c, lone, "node") and job_state(c, lone)["attempt"] <= 1  # no node was ever taken
        with socket.create_server(("", nodes.rendezvous_port)):  # another program holds the only rendezvous port
            nodes.worker("b", GRPO_NODE_NAME="b")
            job_id = c.post("/v1/jobs", json=TWO_NODES).json()["id"]
            taken = wait_for(lambda: _waiting(c, job_id, "is taken"), "a port-taken event", nodes, timeout=60)[0]
        assert f"every port of GRPO_RENDEZVOUS_PORTS ({nodes.rendezvous_port}-" in taken["message"], taken
        assert job_state(c, job_id)["attempt"] <= 1
        job = finished(c, job_id, nodes)
        assert job["status"] == "succeeded" and job["attempt"] == 1, nodes.logs()
        assert_every_step_once(c, job_id, 3)
        joined = [e["data"] for e in _events(c, job_id, "node")]
        assert {(d["node"], d["attempt"]) for d in joined[-2:]} == {(0, 1), (1, 1)}
        assert {d["node_name"] for d in joined[-2:]} == {"a", "b"}  # two machines

        one = c.post("/v1/jobs", json=ONE_NODE).json()["id"]
        assert finished(c, one, nodes)["status"] == "succeeded", nodes.logs()
        two_nodes, one_node = _metrics(c, job_id), _metrics(c, one)
    assert two_nodes.keys() == one_node.keys() and "loss/total" in two_nodes
    for key, points in one_node.items():  # the same ranks on the same shares, summed in the same order
        assert [s for s, _ in two_nodes[key]] == [s for s, _ in points], key
        assert [v for _, v in two_nodes[key]] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-9), key


def _at_step_5_on_two_nodes(cluster) -> int:
    """A 30-step job on workers a and b (two machines), once it has reached step 5: its id."""
    cluster.serve()
    cluster.worker("a", GRPO_NODE_NAME="a")
    cluster.worker("b", GRPO_NODE_NAME="b")
    job = {**LONG_JOB, "resources": {"nodes": 2}, "grpo": {**LONG_JOB["grpo"], "steps": 30}}
    with cluster.client() as c:
        job_id = c.post("/v1/jobs", json=job).json()["id"]
        reached_step(c, job_id, 5, cluster)
    return job_id


def _node_worker(cluster, c, job_id, node: int) -> str:
    """The name of the worker process that runs `node` of the job's latest attempt."""
    holder = [e["data"]["holder"] for e in _events(c, job_id, "node") if e["data"]["node"] == node][-1]
    pid = parent_pid(int(holder.split(":")[1]))  # the pool child's parent: the worker's main process
    return next(name for name, p in cluster.procs.items() if p.pid == pid)


@pytest.mark.long
@pytest.mark.parametrize("lost", [1, 0])
def test_a_killed_node_fails_the_attempt_over_and_the_job_resumes_on_two_workers(nodes, lost):
    job_id = _at_step_5_on_two_nodes(nodes)
    with nodes.client() as c:
        victim = _node_worker(nodes, c, job_id, lost)
        nodes.kill_group(victim)  # kill -9 of that machine's worker and its ranks, mid-step
        nodes.worker("c", GRPO_NODE_NAME="c")  # a machine to take its place
        done = finished(c, job_id, nodes, timeout=240)
        assert done["status"] == "succeeded" and done["attempt"] == 2, nodes.logs()
        assert_every_step_once(c, job_id, 30)
        types = [e["type"] for e in _events(c, job_id)]
        assert "requeued" in types and "resumed" in types, types
        # the node that ran attempt 2 last (an earlier gang of it may have waited for worker c to start)
        second = {e["data"]["node"]: e["data"]["node_name"] for e in _events(c, job_id, "node")
                  if e["data"]["attempt"] == 2}
        assert sorted(second) == [0, 1] and victim not in second.values() and len(set(second.values())) == 2


@pytest.mark.long
def test_a_node_that_hangs_is_noticed_within_the_lease_and_the_job_resumes_without_it(nodes):
    """SIGSTOP of node 1's worker and ranks: its connections stay open, so node 0's ranks would wait in a collective
    for its 30-minute timeout; node 0 sees the node's heartbeat go stale instead and fails the attempt over."""
    job_id = _at_step_5_on_two_nodes(nodes)
    with nodes.client() as c:
        hung = _node_worker(nodes, c, job_id, 1)
        os.killpg(nodes.procs[hung].pid, signal.SIGSTOP)
        try:
            nodes.worker("c", GRPO_NODE_NAME="c")
            done = finished(c, job_id, nodes, timeout=240)
        finally:
            os.killpg(nodes.procs[hung].pid, signal.SIGCONT)
        assert done["status"] == "succeeded" and done["attempt"] == 2, nodes.logs()
        assert_every_step_once(c, job_id, 30)
        (requeued,) = _events(c, job_id, "requeued")
        assert "node 1 stopped answering (no heartbeat for 6 s" in requeued["message"], requeued
        # woken, the hung node finds its attempt over and stops its ranks
        wait_for(lambda: "stopping this node's ranks: attempt 1 is over on node 0" in (
            nodes.tmp_path / f"{hung}.log").read_text(), "the woken node to stop", nodes, timeout=60)
