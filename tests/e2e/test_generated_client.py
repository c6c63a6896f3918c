"""The OpenAPI document is a contract generated clients can use: openapi-python-client builds a client
from the live `/openapi.json` of `grpo-jobs dev`, and that client alone uploads a file, submits a job
on it, polls it, reads its metrics and downloads its checkpoint."""

import importlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import BIN, free_port, wait_http

GENERATOR = Path(sys.executable).parent / "openapi-python-client"


@pytest.mark.slow
def test_a_generated_client_uploads_trains_and_downloads(procs, tmp_path, monkeypatch):
    if not GENERATOR.exists():
        pytest.fail("openapi-python-client is not installed: it is in the dev extra (make install)")
    port = free_port()
    procs.start("dev", "dev", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/readyz", procs)
    key = subprocess.run([str(BIN), "keys", "create", "--owner", "generated"], env=procs.env, capture_output=True,
                         text=True, check=True).stdout.split()[-1]

    doc = tmp_path / "openapi.json"
    doc.write_text(httpx.get(f"{base}/openapi.json").text)
    (tmp_path / "cfg.yaml").write_text("post_hooks: []\nproject_name_override: grpo_client\n"
                                       "package_name_override: grpo_client\n")
    out = tmp_path / "client"
    gen = subprocess.run([str(GENERATOR), "generate", "--path", str(doc), "--config", str(tmp_path / "cfg.yaml"),
                          "--meta", "none", "--output-path", str(out / "grpo_client")], capture_output=True, text=True)
    assert gen.returncode == 0, gen.stdout + gen.stderr
    # the only parts left out: the YAML bodies of /v1/specs/validate (its JSON body is there)
    assert "within files" not in gen.stdout and "within reports" not in gen.stdout, gen.stdout
    monkeypatch.syspath_prepend(str(out))
    c = importlib.import_module("grpo_client")
    from grpo_client.api.files import get_file_v1_files_file_id_get as get_file
    from grpo_client.api.files import upload_file_v1_files_post as upload
    from grpo_client.api.jobs import get_job_v1_jobs_job_id_get as get_job
    from grpo_client.api.jobs import submit_job_v1_jobs_post as submit
    from grpo_client.api.metrics import (
        job_metrics_v1_jobs_job_id_metrics_get as metrics,
    )
    from grpo_client.api.reports import (
        checkpoint_archive_v1_jobs_job_id_checkpoints_step_archive_get as archive,
    )
    from grpo_client.api.reports import (
        job_checkpoints_v1_jobs_job_id_checkpoints_get as checkpoints,
    )
    from grpo_client.models import (
        BodyUploadFileV1FilesPost,
        BodyUploadFileV1FilesPostPurpose,
        GRPOJob,
        JobOut,
    )
    from grpo_client.types import File

    client = c.AuthenticatedClient(base_url=base, token=key, timeout=httpx.Timeout(60))
    rows = "".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                   for a in range(6) for b in range(3))
    up = upload.sync(client=client, body=BodyUploadFileV1FilesPost(
        file=File(payload=io.BytesIO(rows.encode()), file_name="sums.jsonl", mime_type="application/jsonl"),
        purpose=BodyUploadFileV1FilesPostPurpose.TRAIN))
    assert up.rows == 18 and up.format_ == "jsonl", up
    assert get_file.sync(up.id, client=client).sha256 == up.sha256

    spec = {"kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
            "dataset": {"name": "file", "train_file": up.id, "num_val": 2},
            "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6,
                     "eval_prompts": 2, "checkpoint_every": 2}}
    job = submit.sync(client=client, body=GRPOJob.from_dict(spec))
    assert isinstance(job, JobOut), job
    t0 = time.time()
    while (job := get_job.sync(job.id, client=client)).status not in ("succeeded", "failed", "cancelled"):
        assert time.time() - t0 < 300, procs.logs()
        time.sleep(1)
    assert job.status == "succeeded", procs.logs()

    series = metrics.sync(job.id, client=client, keys="reward/mean").series
    assert [p.step for p in series[0].points] == [1, 2]
    assert [ck.step for ck in checkpoints.sync(job.id, client=client)] == [2]
    got = archive.sync(job.id, 2, client=client)
    assert isinstance(got, File), got
    with tarfile.open(fileobj=got.payload, mode="r:gz") as tar:
        names = tar.getnames()
    assert "job-%d-step-2/adapter_model.safetensors" % job.id in names, names
    # sent as application/gzip, or as the bytes type a client that accepts only that asks for
    url, auth = f"{base}/v1/jobs/{job.id}/checkpoints/2/archive", {"Authorization": f"Bearer {key}"}
    assert httpx.get(url, headers=auth).headers["content-type"] == "application/gzip"
    octet = httpx.get(url, headers={**auth, "Accept": "application/octet-stream"})
    assert octet.headers["content-type"] == "application/octet-stream" and octet.content[:2] == b"\x1f\x8b"
    shutil.rmtree(out, ignore_errors=True)
