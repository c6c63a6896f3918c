"""Data in, model out, on the production layout: `grpo-jobs serve` and a separate worker on
PostgreSQL and Redis, each with its own data folder, sharing only an S3-compatible store."""

import json
import subprocess
import uuid

import httpx
import pytest

from service.store import keys as keys_q
from service.store.db import session_scope
from service.store.migrate import upgrade
from tests.conftest import S3Server
from tests.e2e.conftest import BIN, free_port, wait_http, wait_job

WORDS = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box", "jam", "fig"]


def spec(train: str, **model) -> dict:
    return {"kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 4}, **model},
            "dataset": {"name": "file", "train_file": train, "num_val": 2},
            "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6,
                     "eval_prompts": 2, "checkpoint_every": 1}}


@pytest.mark.redis
@pytest.mark.postgres
def test_upload_train_download_with_no_shared_disk(procs, pg_url, redis_url, tmp_path):
    s3 = S3Server()
    try:
        store = s3.settings(f"e2e-{uuid.uuid4().hex[:8]}")
        procs.env.update(DATABASE_URL=pg_url, BROKER_URL=redis_url, **store)
        upgrade(pg_url)
        with session_scope(pg_url) as s:
            key = keys_q.create_key(s, owner=f"e2e-{uuid.uuid4().hex[:6]}")
        port = free_port()
        procs.start("api", "serve", "--port", str(port), env={"GRPO_DATA_DIR": str(tmp_path / "api")})
        # a worker waits 8 s for a store that went away before failing the job
        procs.start("worker", "worker", "--loglevel", "INFO",
                    env={"GRPO_DATA_DIR": str(tmp_path / "worker"), "GRPO_ARTIFACT_RETRY_S": "8"})
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/readyz", procs)
        cli_env = {**procs.env, "GRPO_URL": base, "GRPO_API_KEY": key, "GRPO_DATA_DIR": str(tmp_path / "cli")}

        def cli(*args: str) -> str:
            out = subprocess.run([str(BIN), *args], env=cli_env, capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr + procs.logs()
            return out.stdout

        data = tmp_path / "words.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"Spell {w} backwards.", "answer": w[::-1]}) + "\n" for w in WORDS))
        file_id = cli("files", "upload", str(data), "--purpose", "train").split()[0]
        assert file_id in cli("files", "list")
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
            first = wait_job(c, c.post("/v1/jobs", json=spec(file_id)).json()["id"], procs)
            assert first["status"] == "succeeded", first
            # a second job on the same worker starts from the first one's checkpoint, fetched from the store
            second = wait_job(c, c.post("/v1/jobs", json=spec(file_id, init_from={"job": first["id"]})).json()["id"], procs)
            assert second["status"] == "succeeded", second
            events = c.get(f"/v1/jobs/{second['id']}/events").json()
            assert any(e["type"] == "initialised" and e["data"]["step"] == 2 for e in events)
            samples = c.get(f"/v1/jobs/{first['id']}/samples").json()
            assert samples and all("backwards" in s["prompt"] for s in samples)
            assert not (tmp_path / "api" / "artifacts").exists()  # nothing on the API's disk

            folder = cli("download", str(second["id"]), "--out", str(tmp_path / "got")).strip()
            assert folder.endswith(f"job-{second['id']}-step-2")
            assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
                p.name for p in (tmp_path / "got" / f"job-{second['id']}-step-2").iterdir()}

            # the store goes away: uploads are a 503, a job that needs it fails with a readable event
            s3.stop()
            r = c.post("/v1/files", files={"file": ("w.jsonl", data.read_bytes())}, data={"purpose": "train"})
            assert r.status_code == 503 and "artifact store" in r.json()["detail"]
            ready = c.get("/readyz")
            assert ready.status_code == 503 and ready.json()["checks"]["artifacts"].startswith("unreachable")
            third = wait_job(c, c.post("/v1/jobs", json=spec(file_id)).json()["id"], procs)
            assert third["status"] == "failed" and "ArtifactStoreError" in third["error"], third
            warned = [e for e in c.get(f"/v1/jobs/{third['id']}/events").json() if e["type"] == "warning"]
            assert warned and "retrying for up to 8 s" in warned[0]["message"]
            assert "s3://" in third["error"]  # names the store, never its credentials
    finally:
        s3.stop()
