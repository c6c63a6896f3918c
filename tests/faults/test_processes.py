"""Jobs that span several processes (`resources.processes: 2`) on the production layout: a worker
runs them among single-process jobs, a killed rank fails the attempt and the retry resumes, and
a cancel stops every rank."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.faults.conftest import (
    LONG_JOB,
    assert_every_step_once,
    finished,
    reached_step,
    wait_for,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.faults]

TWO = {**LONG_JOB, "resources": {"processes": 2}}
SHORT_TWO = {**TWO, "grpo": {**TWO["grpo"], "steps": 3, "checkpoint_every": 0}}


def _events(c, job_id) -> list[dict]:
    return c.get(f"/v1/jobs/{job_id}/events").json()


def _pool_pid(c, job_id) -> int:
    """The worker's pool process that holds the job (the holder names it)."""
    return int([e for e in _events(c, job_id) if e["type"] == "started"][-1]["data"]["holder"].split(":")[1])


def _children(ppid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of the live processes whose parent is `ppid`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == ppid:
            found.append((int(proc.name), cmdline))
    return found


def _ranks_of(c, job_id) -> list[int]:
    """The rank processes of a running job: the children of the fork server of the pool process holding it
    (worker/parallel/launch.py), its one child besides multiprocessing's resource tracker."""
    servers = [pid for pid, cmdline in _children(_pool_pid(c, job_id)) if b"resource_tracker" not in cmdline]
    return sorted(pid for server in servers for pid, _ in _children(server))


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
            if (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z":
                return False
        except (ProcessLookupError, FileNotFoundError):
            pass
    return True


def test_a_worker_runs_two_process_jobs_and_a_killed_rank_is_retried_from_its_checkpoint(cluster):
    cluster.serve()
    cluster.worker()
    with cluster.client() as c:
        first = c.post("/v1/jobs", json=SHORT_TWO).json()["id"]
        one = c.post("/v1/jobs", json={**SHORT_TWO, "resources": {"processes": 1}}).json()["id"]
        for job_id in (first, one):
            job = finished(c, job_id, cluster)
            assert job["status"] == "succeeded", cluster.logs()
            assert_every_step_once(c, job_id, 3)

        job_id = c.post("/v1/jobs", json=TWO).json()["id"]
        reached_step(c, job_id, 5, cluster)
        ranks = wait_for(lambda: len(r := _ranks_of(c, job_id)) == 2 and r, "two ranks", cluster, timeout=30)
        os.kill(ranks[1], signal.SIGKILL)
        wait_for(lambda: _gone(ranks), "the other rank to stop with it", cluster, timeout=30)
        job = finished(c, job_id, cluster, timeout=300)
        assert job["status"] == "succeeded" and job["attempt"] == 2, cluster.logs()
        assert_every_step_once(c, job_id, 40)
        events = _events(c, job_id)
        requeued = next(e for e in events if e["type"] == "requeued")
        assert "rank 1: killed by SIGKILL" in requeued["message"] and requeued["level"] == "warning"
        resumed = next(e for e in events if e["type"] == "resumed")
        assert 4 <= resumed["data"]["step"] < 40  # the last checkpoint (every 2 steps) before the kill


def _two_ranks_at_step_3(cluster, c) -> tuple[int, list[int]]:
    """A 2-process job, once it has done 3 steps, and its rank processes."""
    job_id = c.post("/v1/jobs", json=TWO).json()["id"]
    reached_step(c, job_id, 3, cluster)
    return job_id, wait_for(lambda: len(r := _ranks_of(c, job_id)) == 2 and r, "two ranks", cluster, timeout=30)


def test_a_killed_worker_process_takes_its_ranks_with_it_and_the_job_resumes(cluster):
    cluster.serve()
    cluster.worker()
    with cluster.client() as c:
        job_id, ranks = _two_ranks_at_step_3(cluster, c)
        os.kill(_pool_pid(c, job_id), signal.SIGKILL)  # the process holding the lease, not its ranks
        wait_for(lambda: _gone(ranks), "its ranks to die with it", cluster, timeout=30)
        job = finished(c, job_id, cluster, timeout=300)  # the lease expires, the sweep requeues, it resumes
        assert job["status"] == "succeeded" and job["attempt"] == 2, cluster.logs()
        assert_every_step_once(c, job_id, 40)


def test_a_cancel_stops_every_rank(cluster):
    cluster.serve()
    cluster.worker()
    with cluster.client() as c:
        job_id, ranks = _two_ranks_at_step_3(cluster, c)
        t0 = time.monotonic()
        assert c.post(f"/v1/jobs/{job_id}/cancel").json()["cancel_requested"]
        job = finished(c, job_id, cluster)
        assert job["status"] == "cancelled" and job["step"] < 40, cluster.logs()
        wait_for(lambda: _gone(ranks), "every rank to stop", cluster, timeout=30)
        assert time.monotonic() - t0 < 60
        types = [e["type"] for e in _events(c, job_id)]
        assert types.count("stopping") == 1 and types[-1] == "cancelled"
        # the worker takes the next job
        nxt = c.post("/v1/jobs", json=SHORT_TWO).json()["id"]
        assert finished(c, nxt, cluster)["status"] == "succeeded", cluster.logs()
