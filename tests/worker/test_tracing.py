"""OpenTelemetry spans of a job's attempt and of every phase of its steps, exported over OTLP/HTTP
to a receiver on loopback (what a collector gets), from `grpo-jobs run` as a user starts it."""

import subprocess
import time

import pytest
import yaml

from tests.e2e.conftest import BIN, run_env
from tests.otlp import Receiver

JOB = {"kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
       "dataset": {"name": "arith", "num_train": 40, "num_val": 4},
       "grpo": {"steps": 3, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6, "eval_prompts": 2,
                "checkpoint_every": 2, "learning_rate": 1e-2}}


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def _run(tmp_path, spec, env):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return subprocess.run([str(BIN), "run", str(path), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env=run_env(tmp_path / "data", **env))


def test_every_phase_of_every_step_is_a_span_under_its_attempt(tmp_path, receiver):
    r = _run(tmp_path, JOB, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SERVICE_NAME": "trainer-a"})
    assert r.returncode == 0, r.stderr[-3000:]
    time.sleep(0.5)
    (attempt,) = receiver.named("grpo_jobs.attempt")
    assert attempt.parent_id == "" and attempt.attributes["rl.algorithm"] == "grpo"
    assert attempt.attributes["rl.model.name"] == "tiny-random-llama" and attempt.service == "trainer-a"
    steps = receiver.named("rl.loop")
    assert sorted(s.attributes["grpo_jobs.step"] for s in steps) == [1, 2, 3]
    assert all(s.parent_id == attempt.span_id and s.trace_id == attempt.trace_id for s in steps)
    assert all(s.attributes["grpo_jobs.tokens"] > 0 for s in steps)
    step_ids = {s.span_id for s in steps}
    for phase in ("rl.sync", "rl.sample", "rl.reward", "rl.train"):
        spans = receiver.named(phase)
        assert len(spans) == 3 and {s.parent_id for s in spans} == step_ids, phase  # one in each step
    evals = receiver.named("grpo_jobs.evaluate")  # before step 1 (under the attempt) and after the last step
    assert sorted(e.attributes["grpo_jobs.step"] for e in evals) == [0, 3]
    assert [c.attributes["grpo_jobs.step"] for c in receiver.named("grpo_jobs.checkpoint")] in ([2, 3], [3, 2])
    assert not any(s.error for s in receiver.spans)


def test_a_failed_attempt_is_an_error_span_and_no_endpoint_means_no_spans(tmp_path, receiver):
    r = _run(tmp_path / "off", JOB, {})  # no endpoint: nothing is sent, nothing breaks
    assert r.returncode == 0, r.stderr[-3000:]
    assert receiver.spans == []
    # every group ties with a random model: the guard that the spec names stops the job after step 1,
    # which was recorded whole; the attempt is the error
    spec = {**JOB, "health": {"stop_on": ["informative_groups"]}}
    r = _run(tmp_path / "on", spec, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint})
    assert r.returncode != 0 and "HealthStop" in r.stderr
    time.sleep(0.5)
    (step,) = receiver.named("rl.loop")
    (attempt,) = receiver.named("grpo_jobs.attempt")
    assert attempt.error and not step.error and step.parent_id == attempt.span_id


FLUSH_ONE_SPAN = """
import sys, time
from service.core import tracing
tracing.setup("probe")
with tracing.span("grpo_jobs.attempt"):
    pass
t = time.monotonic()
tracing.flush()
print(time.monotonic() - t)
"""


@pytest.mark.parametrize("collector", ["silent", "refusing"])
def test_a_collector_that_does_not_answer_delays_a_jobs_end_by_at_most_a_second(tmp_path, collector):
    """The span flush at a job's end (and the process's exit) waits at most FLUSH_S for a collector that
    accepts and never answers, or refuses: with no bound it waited 10 s and 8 s."""
    import socket
    import sys

    from service.core.tracing import FLUSH_S

    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        if collector == "refusing":
            silent.close()  # nothing listens there any more
        started = time.monotonic()
        r = subprocess.run([sys.executable, "-c", FLUSH_ONE_SPAN], capture_output=True, text=True, timeout=60,
                           env=run_env(tmp_path / "data", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}"))
        whole = time.monotonic() - started
    assert r.returncode == 0, r.stderr[-2000:]
    flushed = float(r.stdout.split()[-1])
    assert flushed < FLUSH_S + 0.25, (flushed, r.stderr[-2000:])
    assert whole < flushed + 5, whole  # the exit waits on nothing more (the import is most of it)
