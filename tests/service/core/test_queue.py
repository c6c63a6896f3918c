"""Which queue a job's message goes to, and which queues a worker consumes: a job reaches only workers with
the GPUs its devices name."""

import pytest

from service.core.queue import queue_for, worker_queues
from service.core.specs import SessionJob, SessionSpec, parse_spec


@pytest.mark.parametrize(("devices", "processes", "gpus"), [
    ({}, 1, 0),  # auto: any worker, its GPU where it has one
    ({"policy": "cpu"}, 1, 0),
    ({"policy": "cuda"}, 1, 1),
    ({"policy": "cuda:0"}, 1, 1),
    ({"policy": "cuda:1"}, 1, 2),  # a worker with a second GPU
    ({"policy": "cpu", "rollout": "cuda:2"}, 1, 3),  # the rollout copy's GPU counts too
    ({"policy": "cuda"}, 4, 4),  # a GPU per process
    ({}, 4, 0),
])
def test_a_job_needs_the_gpus_its_devices_name(devices, processes, gpus):
    spec = parse_spec({"kind": "grpo", "devices": devices, "resources": {"processes": processes},
                       "grpo": {"prompts_per_step": 4}})
    assert spec.gpus == gpus


def test_a_session_run_needs_the_gpu_its_devices_name():
    session = SessionSpec(tinker_session="s", model_id="0" * 32)
    assert SessionJob(session=session).gpus == 0
    assert SessionJob(session=session, devices={"policy": "cuda"}).gpus == 1


def test_a_worker_consumes_the_queue_of_every_job_its_gpus_hold():
    assert [queue_for(n) for n in range(4)] == ["jobs", "gpu", "gpu2", "gpu3"]
    assert worker_queues(0) == ["jobs"]  # a CPU worker never takes a job that names a GPU
    assert worker_queues(2) == ["jobs", "gpu", "gpu2"]  # nor a 2-GPU worker one that needs 3
