import threading
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update

from service.core.artifacts import checkpoint_key, newest_step, open_store
from service.core.specs import GRPOJob
from service.store import events as events_q
from service.store import jobs as jobs_q
from service.store import leases, records
from service.store import metrics as metrics_q
from service.store.db import session_scope
from service.store.migrate import upgrade
from service.store.models import Job, Metric
from worker.jobs import runner

SPEC = {"kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
        "dataset": {"num_train": 40, "num_val": 4},
        "grpo": {"steps": 3, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6, "eval_prompts": 2,
                 "checkpoint_every": 1, "samples_per_step": 2}}


def _setup(settings_factory, spec=SPEC, **extra):
    settings = settings_factory(GRPO_HEARTBEAT_S=0.2, **extra)
    upgrade(settings.store_url)
    spec = GRPOJob.model_validate(spec).model_dump(mode="json")
    with session_scope(settings.store_url) as s:
        job, _ = jobs_q.create_job(s, owner="o", kind="grpo", spec=spec, name=None, total_steps=spec["grpo"]["steps"])
    return settings, job.id


def job_uid(settings, jid) -> str:
    with session_scope(settings.store_url) as s:
        return jobs_q.get_job(s, job_id=jid).uid


def _state(settings, jid):
    with session_scope(settings.store_url) as s:
        job = jobs_q.get_job(s, job_id=jid)
        evs = events_q.list_events(s, job_id=jid)
        keys = metrics_q.list_keys(s, job_id=jid)
        ckpts = records.list_checkpoints(s, job_id=jid)
        n_metric_rows = len(s.execute(select(Metric.step).where(Metric.job_id == jid)).all())
        return job, evs, keys, ckpts, n_metric_rows


def test_runs_a_job_and_records_everything(settings_factory, constant_reward):
    settings, jid = _setup(settings_factory, spec={**SPEC, "rewards": [{"name": "constant"}]})
    assert runner.run_job(jid, settings=settings) == "succeeded"
    job, evs, keys, ckpts, _ = _state(settings, jid)
    assert (job.status, job.step, job.attempt, job.lease_owner) == ("succeeded", 3, 1, None)
    assert [e.type for e in evs if e.type not in ("groups", "health")] == [
        "created", "started", "fingerprint", "model_loaded", "memory_plan", "checkpoint", "checkpoint", "checkpoint",
        "succeeded"]
    # every group ties (a constant reward): flagged at step 1, the update guard red by step 3
    flags = [(e.data["guard"], e.data["level"], e.data["step"]) for e in evs if e.type == "health"]
    assert ("informative_groups", "critical", 1) in flags and ("update", "critical", 3) in flags
    assert {"reward/mean", "loss/total", "entropy", "eval/accuracy", "time/step_s"} <= set(keys)
    assert "kl" not in keys  # kl_coef 0 and no grpo.measure_kl: not measured, so not reported
    assert [c.step for c in ckpts] == [1, 2, 3] and all(c.format == "peft-lora" for c in ckpts)
    # a redelivered message for a finished job does nothing
    assert runner.run_job(jid, settings=settings) == "skipped"


def test_failure_is_readable_and_keeps_records(settings_factory, tmp_path):
    spec = {**SPEC, "model": {"name": "no-such-model"}}  # passes the spec; gone by the time it runs
    settings, jid = _setup(settings_factory, spec)
    with session_scope(settings.store_url) as s:
        metrics_q.upsert_step(s, job_id=jid, step=0, values={"eval/accuracy": 0.5})
    assert runner.run_job(jid, settings=settings) == "failed"
    job, evs, keys, _, _ = _state(settings, jid)
    assert job.status == "failed" and "no-such-model" in job.error
    failed = [e for e in evs if e.type == "failed"][0]
    assert failed.level == "error" and "no-such-model" in failed.message
    assert set(failed.data) == {"error_type"}  # the traceback goes to the worker log, not the API
    assert keys == ["eval/accuracy"]


def test_gives_up_after_max_attempts(settings_factory):
    settings, jid = _setup(settings_factory, GRPO_MAX_ATTEMPTS=2)
    with session_scope(settings.store_url) as s:  # two earlier deliveries died mid-job
        s.execute(update(Job).where(Job.id == jid).values(
            status="running", attempt=2, lease_owner="dead",
            heartbeat_at=datetime.now(UTC) - timedelta(hours=1)))
    assert runner.run_job(jid, settings=settings) == "failed"
    job, evs, *_ = _state(settings, jid)
    assert "gave up after 2 attempts" in job.error


def test_busy_when_another_worker_holds_the_lease(settings_factory):
    settings, jid = _setup(settings_factory)
    assert leases.acquire_lease(settings.store_url, job_id=jid, holder="other", lease_timeout_s=60)
    assert runner.run_job(jid, settings=settings) == "busy"


def test_cancel_stops_between_steps_with_a_checkpoint(settings_factory):
    spec = {**SPEC, "grpo": {**SPEC["grpo"], "steps": 50, "checkpoint_every": 0}}
    settings, jid = _setup(settings_factory, spec)
    def cancel_at_step_2():  # the cancel lands while the job runs
        while True:
            with session_scope(settings.store_url) as s:
                if jobs_q.get_job(s, job_id=jid).step >= 2:
                    s.execute(update(Job).where(Job.id == jid).values(cancel_requested=True))
                    return
            time.sleep(0.05)

    canceller = threading.Thread(target=cancel_at_step_2, daemon=True)
    canceller.start()
    assert runner.run_job(jid, settings=settings) == "cancelled"
    canceller.join()
    job, evs, _, ckpts, _ = _state(settings, jid)
    assert job.status == "cancelled" and job.step < 50
    assert ckpts and ckpts[-1].step == job.step


def test_redelivery_after_a_crash_resumes_from_the_checkpoint(settings_factory, store_settings):
    settings, jid = _setup(settings_factory, **store_settings)
    assert runner.run_job(jid, settings=settings) == "succeeded"
    _, _, _, _, rows_once = _state(settings, jid)
    # Pretend the worker died after step 2: state as the crash left it, last checkpoint step-2.
    assert open_store(settings).delete(checkpoint_key(job_uid(settings, jid), 3)) > 0
    with session_scope(settings.store_url) as s:
        s.execute(update(Job).where(Job.id == jid).values(
            status="running", step=2, lease_owner="dead", finished_at=None,
            heartbeat_at=datetime.now(UTC) - timedelta(hours=1)))
    assert runner.run_job(jid, settings=settings) == "succeeded"
    job, evs, _, _, rows_twice = _state(settings, jid)
    assert job.attempt == 2 and job.step == 3
    resumed = [e for e in evs if e.type == "resumed"]
    assert resumed and "step 2" in resumed[0].message
    assert rows_twice == rows_once  # step 3 was re-reported as upserts, not duplicated
    # the store holds every checkpoint, the worker's disk none of the object store's (staging is removed)
    assert newest_step(open_store(settings).list(f"{job.uid}/checkpoints")) == 3
    if store_settings:
        assert not (settings.cache_dir / job.uid / "checkpoints" / "step-3").exists()


def test_failure_messages_name_settings_not_server_paths(settings_factory):
    settings = settings_factory()
    message = f"OSError: cannot read {settings.datasets_dir}/alice/x.jsonl or {settings.data_dir}/other"
    clean = runner.without_server_paths(message, settings)
    assert clean == "OSError: cannot read $GRPO_DATASETS_ROOT/alice/x.jsonl or $GRPO_DATA_DIR/other"


def test_a_stored_spec_this_version_refuses_fails_the_job_saying_why(settings_factory):
    """A row written by another version (here: a field this one does not know) is leased, not run."""
    settings, jid = _setup(settings_factory)
    with session_scope(settings.store_url) as s:
        job = jobs_q.get_job(s, job_id=jid)
        job.spec = {**job.spec, "grpo": {**job.spec["grpo"], "retired_option": 1}}
    lease = leases.acquire_lease(settings.store_url, job_id=jid, holder="w", lease_timeout_s=0)
    assert lease.spec is None and "stored spec is no longer valid: 1 errors" in lease.spec_error
    with session_scope(settings.store_url) as s:  # back to queued, as a fresh delivery finds it
        s.execute(update(Job).where(Job.id == jid).values(status="queued", lease_owner=None, attempt=0))
    assert runner.run_job(jid, settings=settings) == "failed"
    with session_scope(settings.store_url) as s:
        assert "stored spec is no longer valid" in jobs_q.get_job(s, job_id=jid).error
        assert events_q.list_events(s, job_id=jid)[-1].type == "failed"
