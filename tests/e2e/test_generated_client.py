"""The OpenAPI document is a contract generated clients can use: openapi-python-client builds a client
from the live `/openapi.json` of `grpo-jobs dev`, and that client alone calls every operation: uploads a
file, trains on it, polls, reads every report, downloads the checkpoint, and drives a tinker training
run from create_model to a sample."""

import importlib
import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import BIN, Procs, embedded_env, free_port, wait_http
from tests.webhook_receiver import WebhookReceiver

GENERATOR = Path(sys.executable).parent / "openapi-python-client"


@pytest.fixture(scope="module")
def generated(tmp_path_factory, models_root):
    """`grpo-jobs dev` on a free port, an API key, and a client generated from its live /openapi.json:
    (base URL, key, the generated package, the names of every operation module it generated)."""
    if not GENERATOR.exists():
        pytest.fail("openapi-python-client is not installed: it is in the dev extra (make install)")
    tmp_path = tmp_path_factory.mktemp("generated")
    hooks = WebhookReceiver()
    procs = Procs({**embedded_env(tmp_path / "data", models_root), "GRPO_WEBHOOK_URLS": f"{hooks.base}/hooks"},
                  tmp_path)
    out = tmp_path / "client"
    try:
        port = free_port()
        procs.start("dev", "dev", "--port", str(port))
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/readyz", procs)
        key = subprocess.run([str(BIN), "keys", "create", "--owner", "generated"], env=procs.env, capture_output=True,
                             text=True, check=True).stdout.split()[-1]
        doc = tmp_path / "openapi.json"
        doc.write_text(httpx.get(f"{base}/openapi.json", timeout=60).text)  # built on first ask: seconds on a busy CPU
        (tmp_path / "cfg.yaml").write_text("post_hooks: []\nproject_name_override: grpo_client\n"
                                           "package_name_override: grpo_client\n")
        gen = subprocess.run([str(GENERATOR), "generate", "--path", str(doc), "--config", str(tmp_path / "cfg.yaml"),
                              "--meta", "none", "--output-path", str(out / "grpo_client")], capture_output=True,
                             text=True)
        assert gen.returncode == 0, gen.stdout + gen.stderr
        # the only parts left out: the YAML bodies of /v1/specs/validate (its JSON body is there) and the
        # protobuf media type of forward_backward (its application/octet-stream body is there)
        assert "will not be generated" not in gen.stdout, gen.stdout
        sys.path.insert(0, str(out))
        package = importlib.import_module("grpo_client")
        operations = {f"{m.parent.name}.{m.stem}" for m in (out / "grpo_client" / "api").glob("*/*.py")
                      if m.stem != "__init__"}
        yield base, key, package, operations, procs
    finally:
        if str(out) in sys.path:
            sys.path.remove(str(out))
        procs.stop()
        hooks.close()


@pytest.mark.slow
def test_a_generated_client_calls_every_operation(generated):
    """Every operation the generator made, called through the generated code alone, answers the status it
    documents with a body the generated model parses (None would mean an undocumented answer)."""
    import numpy as np

    from service.core.tinker.wire import pb

    base, key, c, operations, procs = generated
    client = c.AuthenticatedClient(base_url=base, token=key, timeout=httpx.Timeout(60))
    m = importlib.import_module("grpo_client.models")
    File = importlib.import_module("grpo_client.types").File
    called: set[str] = set()

    def call(op: str, *args, status: int = 200, **kw):
        mod = importlib.import_module(f"grpo_client.api.{op}")
        r = mod.sync_detailed(*args, client=client, **kw)
        assert r.status_code == status, (op, r.status_code, r.content[:500], procs.logs())
        assert r.parsed is not None or status == 204, (op, "an answer the document does not describe", r.content)
        called.add(op)
        return r.parsed

    def result(request_id: str) -> dict:
        t0 = time.time()
        while (got := call("tinker.retrieve_future_api_v1_retrieve_future_post",
                           body=m.RetrieveFutureIn(request_id=request_id)).to_dict()).get("type") == "try_again":
            assert time.time() - t0 < 120, procs.logs()
        assert "error" not in got, got
        return got

    assert call("health.healthz_healthz_get") and call("health.readyz_readyz_get")
    assert "numeric_match" in [r.name for r in call("rewards.list_rewards_v1_rewards_get").items]
    # files
    rows = "".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                   for a in range(6) for b in range(3))
    up = call("files.upload_file_v1_files_post", status=201, body=m.BodyUploadFileV1FilesPost(
        file=File(payload=io.BytesIO(rows.encode()), file_name="sums.jsonl", mime_type="application/jsonl"),
        purpose=m.BodyUploadFileV1FilesPostPurpose.TRAIN))
    assert call("files.get_file_v1_files_file_id_get", up.id).rows == 18
    assert call("files.file_content_v1_files_file_id_content_get", up.id).payload.read() == rows.encode()
    assert [f.id for f in call("files.list_files_v1_files_get").items] == [up.id]
    # a GRPO job with sparsity reports on the uploaded file, and a TracIn job: every report route has rows
    spec = {"kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
            "dataset": {"name": "file", "train_file": up.id, "num_val": 2},
            "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6,
                     "eval_prompts": 2, "checkpoint_every": 2, "samples_per_step": 2},
            "sparsity": {"measure_interval": 1}}
    tracin = {"kind": "tracin", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
              "grpo": {"steps": 1, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6},
              "tracin": {"val_prompts": 2, "val_generations": 2, "check_prediction": True}}
    assert call("specs.validate_spec_v1_specs_validate_post",
                body=m.ValidateSpecV1SpecsValidatePostJsonBody.from_dict(spec)).valid
    hook = call("webhooks.create_webhook_v1_webhooks_post", status=201,
                body=m.WebhookIn.from_dict({"url": procs.env["GRPO_WEBHOOK_URLS"], "events": ["job.succeeded"]}))
    assert [h.id for h in call("webhooks.list_webhooks_v1_webhooks_get")] == [hook.id]
    job = call("jobs.submit_job_v1_jobs_post", status=201, body=m.GRPOJob.from_dict(spec))
    selecting = call("jobs.submit_job_v1_jobs_post", status=201, body=m.TracInJob.from_dict(tracin))
    t0 = time.time()
    for j in (job, selecting):
        while call("jobs.get_job_v1_jobs_job_id_get", j.id).status not in ("succeeded", "failed", "cancelled"):
            assert time.time() - t0 < 300, procs.logs()
            time.sleep(1)
        assert call("jobs.get_job_v1_jobs_job_id_get", j.id).status == "succeeded", procs.logs()
    assert [j.id for j in call("jobs.list_jobs_v1_jobs_get").items] == [selecting.id, job.id]
    assert "succeeded" in [e.type_ for e in call("jobs.job_events_v1_jobs_job_id_events_get", job.id)]
    token = call("jobs.stream_token_v1_jobs_job_id_stream_token_post", job.id).token
    assert "event: end" in call("jobs.stream_job_v1_jobs_job_id_stream_get", job.id, access_token=token)
    assert call("metrics.job_metrics_v1_jobs_job_id_metrics_get", job.id, keys="reward/mean").series
    assert call("metrics.job_metrics_latest_v1_jobs_job_id_metrics_latest_get", job.id).to_dict()
    assert [ck.step for ck in call("reports.job_checkpoints_v1_jobs_job_id_checkpoints_get", job.id)] == [2]
    archive = call("reports.checkpoint_archive_v1_jobs_job_id_checkpoints_step_archive_get", job.id, 2)
    with tarfile.open(fileobj=archive.payload, mode="r:gz") as tar:
        assert f"job-{job.id}-step-2/adapter_model.safetensors" in tar.getnames()
    # sent as application/gzip, or as the bytes type a client that accepts only that asks for
    url, auth = f"{base}/v1/jobs/{job.id}/checkpoints/2/archive", {"Authorization": f"Bearer {key}"}
    assert httpx.get(url, headers=auth).headers["content-type"] == "application/gzip"
    octet = httpx.get(url, headers={**auth, "Accept": "application/octet-stream"})
    assert octet.headers["content-type"] == "application/octet-stream" and octet.content[:2] == b"\x1f\x8b"
    assert call("reports.job_samples_v1_jobs_job_id_samples_get", job.id)
    reports = call("reports.job_sparsity_v1_jobs_job_id_sparsity_get", job.id)
    assert call("reports.job_sparsity_report_v1_jobs_job_id_sparsity_report_id_get", job.id, reports[0].id).id \
        == reports[0].id
    assert call("reports.job_selections_v1_jobs_job_id_selections_get", selecting.id)
    assert call("reports.tracin_prediction_v1_jobs_job_id_tracin_prediction_get", selecting.id).job_id == selecting.id
    assert call("jobs.cancel_job_v1_jobs_job_id_cancel_post", job.id, status=409).detail  # it has ended
    assert {d.job_id for d in call("webhooks.list_deliveries_v1_webhooks_webhook_id_deliveries_get", hook.id)} == {
        job.id, selecting.id}
    call("webhooks.delete_webhook_v1_webhooks_webhook_id_delete", hook.id, status=204)
    assert call("workers.job_nodes_v1_jobs_job_id_nodes_get", selecting.id).items == []  # one machine: no nodes
    call("jobs.delete_job_v1_jobs_job_id_delete", job.id, status=204)
    call("jobs.delete_job_v1_jobs_job_id_delete", selecting.id, status=204)
    call("files.delete_file_v1_files_file_id_delete", up.id, status=204)
    # the tinker-compatible routes, as the SDK sequences them
    assert call("tinker.healthz_api_v1_healthz_get").status == "ok"
    assert call("tinker.client_config_api_v1_client_config_post", body=m.ClientConfigIn()).pjwt_auth_enabled is False
    assert call("tinker.client_dynamic_config_api_v1_client_dynamic_config_post", body=m.ClientConfigIn())
    assert call("tinker.server_capabilities_api_v1_get_server_capabilities_get").supported_models
    assert call("tinker.telemetry_api_v1_telemetry_post").status == "accepted"
    sid = call("tinker.create_session_api_v1_create_session_post", body=m.CreateSessionIn()).session_id
    assert call("tinker.session_heartbeat_api_v1_session_heartbeat_post", body=m.SessionIdIn(session_id=sid))
    assert call("tinker.list_sessions_api_v1_sessions_get").sessions == [sid]
    made = call("tinker.create_model_api_v1_create_model_post", body=m.CreateModelIn.from_dict(
        {"session_id": sid, "base_model": "tiny-random-llama", "lora_config": {"rank": 4, "seed": 0}}))
    model_id = made.model_id
    result(made.request_id)
    assert call("tinker.get_session_api_v1_sessions_session_id_get", sid).training_run_ids == [model_id]
    assert call("tinker.get_info_api_v1_get_info_post", body=m.ModelIdIn(model_id=model_id)).lora_rank == 4
    p = pb()  # a forward_backward body as the SDK encodes it
    msg = p.ForwardBackwardRequest(model_id=model_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([5, 9, 14, 3], dtype=np.int32).tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.dense = p.DTYPE_INT64, np.array([9, 14, 3, 22], dtype=np.int64).tobytes()
    fb = call("tinker.forward_backward_api_v1_forward_backward_post",
              body=File(payload=io.BytesIO(msg.SerializeToString()), mime_type="application/octet-stream"))
    out = result(fb.request_id)  # JSON: the generated client does not ask for protobuf
    assert out["metrics"]["loss:sum"] > 0 and len(out["loss_fn_outputs"][0]["logprobs"]["data"]) == 4
    result(call("tinker.optim_step_api_v1_optim_step_post", body=m.OptimStepIn.from_dict(
        {"model_id": model_id, "adam_params": {"learning_rate": 0.01}})).request_id)
    result(call("tinker.save_weights_for_sampler_api_v1_save_weights_for_sampler_post",
                body=m.SaveForSamplerIn(model_id=model_id)).request_id)
    result(call("tinker.save_weights_api_v1_save_weights_post",
                body=m.SaveWeightsIn(model_id=model_id, path="first")).request_id)
    path = f"tinker://{model_id}/weights/first"
    assert call("tinker.weights_info_api_v1_weights_info_post", body=m.WeightsInfoIn(tinker_path=path)).lora_rank == 4
    result(call("tinker.load_weights_api_v1_load_weights_post",
                body=m.LoadWeightsIn(model_id=model_id, path=path)).request_id)
    sampler = call("tinker.create_sampling_session_api_v1_create_sampling_session_post", body=m.CreateSamplingSessionIn(
        session_id=sid, model_path=path)).sampling_session_id
    assert call("tinker.get_sampler_api_v1_samplers_sampling_session_id_get", sampler).base_model == "tiny-random-llama"
    drawn = result(call("tinker.asample_api_v1_asample_post", body=m.SampleIn.from_dict(
        {"sampling_session_id": sampler, "num_samples": 2, "prompt": {"chunks": [{"tokens": [5, 9, 14]}]},
         "sampling_params": {"max_tokens": 3, "seed": 1}})).request_id)
    assert len(drawn["sequences"]) == 2
    assert [r.training_run_id for r in call("tinker.list_training_runs_api_v1_training_runs_get").training_runs] \
        == [model_id]
    assert call("tinker.get_training_run_api_v1_training_runs_model_id_get", model_id).training_run_id == model_id
    assert [ck.checkpoint_id for ck in call("tinker.list_checkpoints_api_v1_training_runs_model_id_checkpoints_get",
                                           model_id).checkpoints] == ["weights/first"]
    assert call("tinker.list_user_checkpoints_api_v1_checkpoints_get").checkpoints
    call("tinker.delete_checkpoint_api_v1_training_runs_model_id_checkpoints_kind_name_delete", model_id,
         m.DeleteCheckpointApiV1TrainingRunsModelIdCheckpointsKindNameDeleteKind.WEIGHTS, "first", status=204)
    call("tinker.finish_session_api_v1_sessions_session_id_finish_post", sid, status=204)
    (worker,) = call("workers.list_workers_v1_workers_get").items  # dev's one worker, which ran the jobs
    assert worker.gpus == [] and worker.queues == ["jobs"] and worker.concurrency == 1
    called.add("tinker.retrieve_future_api_v1_retrieve_future_post")
    assert called == operations, sorted(operations - called)
    assert len(operations) == 59
