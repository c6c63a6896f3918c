"""`grpo-jobs serve` logs every request (uvicorn's access log at level info): no API key and no
stream token may appear in it while a client streams a job as the dashboard does."""

import subprocess

import httpx

from tests.e2e.conftest import BIN, TINY_JOB, free_port, wait_http


def test_keys_and_stream_tokens_stay_out_of_the_server_log(procs, tmp_path):
    key = subprocess.run([str(BIN), "keys", "create", "--owner", "logs"], env=procs.env, check=True,
                         capture_output=True, text=True).stdout.strip()
    port = free_port()
    api = procs.start("api", "serve", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/healthz", procs)
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        jid = c.post("/v1/jobs", json=TINY_JOB).json()["id"]  # no worker: it stays queued
        token = c.post(f"/v1/jobs/{jid}/stream-token").json()["token"]
        with httpx.stream("GET", f"{base}/v1/jobs/{jid}/stream", params={"access_token": token, "from_step": -1},
                          timeout=30) as r:  # as the dashboard's EventSource opens it
            assert r.status_code == 200
            assert "event: status" in next(r.iter_text())
        assert c.get(f"/v1/jobs/{jid}").status_code == 200
        assert c.get(f"/v1/jobs/{jid}", params={"access_token": key}).status_code == 422  # refused, and...
    api.terminate()
    api.wait(timeout=30)
    log = (tmp_path / "api.log").read_text()
    assert f"/v1/jobs/{jid}/stream" in log  # the access log is on
    assert key not in log and token not in log  # ...never logged
    assert "access_token=[redacted]" in log
