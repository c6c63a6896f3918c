"""What a worker reads of its GPUs at start, and the queues it then consumes."""

import logging
import sys
from types import SimpleNamespace

from service.core.records import GpuInfo
from worker.jobs import celery_app
from worker.machine import inventory


def test_no_driver_means_no_gpus_and_no_child_started(monkeypatch):
    monkeypatch.setattr(inventory, "DRIVER_NODES", ("/nonexistent/nvidiactl",))
    monkeypatch.setattr(inventory.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert inventory.gpus() == []


def test_devices_hidden_by_the_admin_mean_no_gpus(monkeypatch):
    monkeypatch.setattr(inventory, "DRIVER_NODES", (sys.executable,))  # a driver "present"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert inventory.gpus() == []


def test_the_child_reads_what_torch_sees(monkeypatch):
    """With a driver node present the child interpreter runs for real; on this CPU machine torch sees none."""
    monkeypatch.setattr(inventory, "DRIVER_NODES", (sys.executable,))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert inventory.gpus() == []


def test_a_child_that_fails_is_logged_and_the_worker_takes_cpu_jobs(monkeypatch, caplog):
    monkeypatch.setattr(inventory, "DRIVER_NODES", (sys.executable,))
    monkeypatch.setattr(inventory, "_READ", "raise SystemExit('no NVML')")
    with caplog.at_level(logging.WARNING, logger=inventory.__name__):
        assert inventory.gpus() == []
    assert "could not read this worker's GPUs" in caplog.text


def test_a_worker_with_two_gpus_consumes_the_queues_of_jobs_needing_one_or_two(monkeypatch):
    h100 = GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", memory_bytes=85_520_809_984)
    monkeypatch.setattr(inventory, "gpus", lambda: [h100, h100])
    added: list[str] = []
    instance = SimpleNamespace(concurrency=2, app=SimpleNamespace(amqp=SimpleNamespace(
        queues=SimpleNamespace(select_add=added.append))))
    monkeypatch.setattr(celery_app, "_me", None)
    celery_app._consume_what_it_can_run(sender="w@node", instance=instance)
    assert added == ["jobs", "gpu", "gpu2"]
    me = celery_app._me
    assert me is not None and me.gpus == [h100, h100] and me.queues == added and me.concurrency == 2
