"""A job on uploaded files, end to end through the API: train, download the checkpoint, evaluate
it in a fresh process, train on from it, delete the job."""

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from sqlalchemy import func, select

from service.core.artifacts import open_store
from service.store.db import session_scope
from service.store.models import (
    Checkpoint,
    Job,
    JobEvent,
    Metric,
    Sample,
    Selection,
    SparsityReport,
)
from tests.conftest import Api

ROOT = Path(__file__).resolve().parents[3]
WORDS = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box", "jam", "fig", "owl", "bee"]
TRAIN = [{"prompt": f"Spell {w} backwards.", "answer": w[::-1]} for w in WORDS[:8]]
EVAL = [{"prompt": f"Spell {w} backwards.", "answers": [w[::-1], w[::-1].upper()]} for w in WORDS[8:]]


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def spec(train, val, **grpo):
    # float32: a downloaded checkpoint evaluated by plain transformers gives the job's own evaluation exactly
    return {"kind": "grpo", "model": {"name": "tiny-random-llama", "dtype": "float32", "lora": {"r": 4}},
            "dataset": {"name": "file", "train_file": train, "val_file": val},
            "rewards": [{"name": "digit_share"}],  # dense even for a random model
            "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 8,
                     "micro_batch_size": 4, "eval_prompts": 4, "checkpoint_every": 1, "samples_per_step": 8,
                     "learning_rate": 1e-3, **grpo},
            "sparsity": {"measure_interval": 1}}


def counts(api, jid) -> dict[str, int]:
    with session_scope(api.settings.store_url) as s:
        return {t.__tablename__: s.scalar(select(func.count()).select_from(t).where(t.job_id == jid))
                for t in (JobEvent, Metric, Sample, Selection, SparsityReport, Checkpoint)} | {
            "jobs": s.scalar(select(func.count()).select_from(Job).where(Job.id == jid))}


@pytest.mark.slow
def test_train_download_evaluate_continue_delete(settings_factory, store_settings, tmp_path, digit_reward):
    api = Api(settings_factory(**store_settings))
    train = api.upload(jsonl(TRAIN)).json()["id"]
    val = api.upload(jsonl(EVAL), "eval", filename="eval.jsonl").json()["id"]
    jid = api.run_job(spec(train, val))

    prompts = {s["prompt"] for s in api.get(f"/v1/jobs/{jid}/samples").json()}
    assert prompts and all(any(r["prompt"] in p for r in TRAIN) for p in prompts)  # the uploaded prompts
    ckpts = api.get(f"/v1/jobs/{jid}/checkpoints").json()
    assert [(c["step"], c["format"]) for c in ckpts] == [(1, "peft-lora"), (2, "peft-lora")]
    assert all("path" not in c for c in ckpts)

    r = api.get(f"/v1/jobs/{jid}/checkpoints/2/archive")
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
        names = tar.getnames()
        tar.extractall(tmp_path, filter="data")
    top = f"job-{jid}-step-2"
    assert f"{top}/adapter_model.safetensors" in names and f"{top}/tokenizer.json" in names
    assert f"{top}/trainer_state.pt" not in names  # optimizer state stays in the service
    adapter = json.loads((tmp_path / top / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "tiny-random-llama"  # a public name, not a server folder
    assert api.get(f"/v1/jobs/{jid}/checkpoints/7/archive").status_code == 404
    assert api.get(f"/v1/jobs/{jid}/checkpoints/2/archive", key=api.bob).status_code == 404

    # a fresh process with plain transformers + peft gives the job's own final evaluation
    (tmp_path / "eval.jsonl").write_bytes(jsonl(EVAL))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_checkpoint.py"), "--checkpoint",
                          str(tmp_path / top), "--base", "tiny-random-llama", "--data", str(tmp_path / "eval.jsonl"),
                          "--limit", "4", "--max-new-tokens", "8", "--batch", "8", "--reward", "tests.conftest:_digit_share"],
                         capture_output=True, text=True, check=True, timeout=300, cwd=ROOT)
    outside = json.loads(out.stdout.strip().splitlines()[-1])
    series = api.get(f"/v1/jobs/{jid}/metrics?keys=eval/reward_mean,eval/accuracy").json()["series"]
    final = {s["key"]: s["points"][-1] for s in series}
    assert final["eval/reward_mean"]["step"] == 2 and final["eval/accuracy"]["step"] == 2
    assert 0 < outside["reward_mean"] < 1  # dense: equal means equal completions
    assert outside["reward_mean"] == pytest.approx(final["eval/reward_mean"]["value"], abs=1e-6)
    assert outside["accuracy"] == pytest.approx(final["eval/accuracy"]["value"], abs=1e-6)

    # train on from it: the new job starts from its latest checkpoint's weights
    follow = spec(train, val, steps=2) | {"kind": "tracin", "tracin": {"selection": "top_fraction"}, "model": {"name": "tiny-random-llama", "lora": {"r": 4},
                                                                       "init_from": {"job": jid}}}
    jid2 = api.run_job(follow)
    started = [e for e in api.get(f"/v1/jobs/{jid2}/events").json() if e["type"] == "initialised"]
    assert started and started[0]["data"] == {"job": jid, "step": 2}
    # while an unfinished job starts from it, it cannot be deleted; once that one is finished, it can
    queued = api.post("/v1/jobs", json=follow).json()["id"]
    r = api.delete(f"/v1/jobs/{jid}")
    assert r.status_code == 409 and str(queued) in r.json()["detail"]
    assert api.delete(f"/v1/jobs/{queued}").status_code == 409  # not finished
    assert api.post(f"/v1/jobs/{queued}/cancel").json()["status"] == "cancelled"
    assert api.delete(f"/v1/jobs/{jid}").status_code == 204

    before = counts(api, jid2)
    assert all(before.values()), before
    uid2 = api.get(f"/v1/jobs/{jid2}").json()["uid"]
    files_before = len(open_store(api.settings).list(uid2))
    assert files_before > 0
    assert api.delete(f"/v1/jobs/{jid2}", key=api.bob).status_code == 404
    assert api.delete(f"/v1/jobs/{jid2}").status_code == 204
    assert set(counts(api, jid2).values()) == {0} and open_store(api.settings).list(uid2) == []
    assert api.get(f"/v1/jobs/{jid2}").status_code == 404
    assert [f["id"] for f in api.get("/v1/files").json()["items"]] == [val, train]  # files stay
