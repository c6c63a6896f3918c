"""`grpo-jobs dev`: API + worker on the embedded defaults (SQLite store, SQLite broker)."""

import subprocess
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import (
    BIN,
    SFT_JOB,
    TINY_JOB,
    check_finished_job,
    check_finished_sft_job,
    check_still_waiting,
    parent_pid,
    start_dev,
    submit_gpu_job,
    wait_job,
)
from tests.webhook_receiver import WebhookReceiver


def test_dev_runs_a_job_end_to_end(procs):
    hooks = WebhookReceiver()
    base, key = start_dev(procs, GRPO_WEBHOOK_URLS=f"{hooks.base}/hooks")
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        hook = c.post("/v1/webhooks", json={"url": f"{hooks.base}/hooks", "events": ["job.succeeded"]}).json()
        gpu_job = submit_gpu_job(c, procs)
        r = c.post("/v1/jobs", json=TINY_JOB)
        assert r.status_code == 201, r.text
        check_finished_job(c, wait_job(c, r.json()["id"], procs))
        # the worker's deliverer POSTs the outcome, signed with the webhook's secret
        assert hooks.wait_for("job.succeeded", r.json()["id"]).signed_by(hook["secret"])
        hooks.close()
        # the CLI says what the API says: red, and why
        out = subprocess.run([str(BIN), "status", str(r.json()["id"]), "--url", base, "--key", key],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "health: critical" in out.stdout and "critical step 1: informative_groups is 0" in out.stdout, out.stdout
        # the same spec again: the same fingerprint, the same learned metrics
        try:
            out = subprocess.run([str(BIN), "reproduce", str(r.json()["id"]), "--wait", "--url", base, "--key", key],
                                 capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"reproduce did not finish: {exc.stdout}\n{procs.logs()}") from None
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"(reproduces job {r.json()['id']})" in out.stdout
        assert "fingerprints: identical" in out.stdout and "metrics: equal" in out.stdout, out.stdout
        # the same job as two processes, on the same worker
        r = c.post("/v1/jobs", json={**TINY_JOB, "resources": {"processes": 2}})
        assert r.status_code == 201, r.text
        check_finished_job(c, wait_job(c, r.json()["id"], procs))
        r = c.post("/v1/jobs", json=SFT_JOB)
        assert r.status_code == 201, r.text
        check_finished_sft_job(c, wait_job(c, r.json()["id"], procs))
        check_still_waiting(c, gpu_job)
        # a long job can be cancelled while it runs and keeps what it recorded
        long = {**TINY_JOB, "grpo": {**TINY_JOB["grpo"], "steps": 500, "checkpoint_every": 0}}
        jid = c.post("/v1/jobs", json=long).json()["id"]
        for _ in range(120):
            if c.get(f"/v1/jobs/{jid}").json()["step"] >= 2:
                break
            time.sleep(0.5)
        assert c.post(f"/v1/jobs/{jid}/cancel").json()["cancel_requested"]
        job = wait_job(c, jid, procs, timeout=120)
        assert job["status"] == "cancelled" and 2 <= job["step"] < 500
        assert c.get(f"/v1/jobs/{jid}/checkpoints").json()[-1]["step"] == job["step"]
        assert c.get(f"/v1/jobs/{jid}/metrics/latest").json()["reward/mean"]["step"] == job["step"]
    # SIGTERM (a supervisor, `docker stop`) stops the worker too, as Ctrl-C does
    dev = procs.procs[0][1]
    worker_pids = children(dev.pid)
    assert worker_pids, "dev runs its worker as a child process"
    dev.terminate()
    dev.wait(timeout=60)
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(p) for p in worker_pids):
        time.sleep(0.2)
    assert not any(alive(p) for p in worker_pids), "dev left its worker running"


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc)."""
    parents = {int(e.name): parent_pid(int(e.name)) for e in Path("/proc").iterdir() if e.name.isdigit()}
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
