"""Where a job's vLLM server runs on a GPU worker, and the share of the card's memory it takes: decided
from the worker's GPUs and the trainer's, and written into the server's command line and environment
(no server is started: the engine's own tests start real ones on this CPU machine)."""

from pathlib import Path

import pytest
import torch

from worker.engines.vllm_engine import (
    COLOCATED_MEMORY,
    OWN_GPU_MEMORY,
    EnginePlacement,
    ServerConfig,
    VLLMServer,
    place_engine,
)
from worker.loops.setup import option_value, without_option


def test_the_server_takes_a_gpu_no_rank_trains_on_or_a_small_share_of_the_trainers():
    assert place_engine(set(), 0, None) == EnginePlacement(None, False, None)  # a CPU worker
    assert place_engine(set(), 0, 0.5) == EnginePlacement(None, False, None)  # nothing to share on a CPU
    # one GPU: shared with the trainer, within TRL's colocated share unless the job asks for another
    assert place_engine({0}, 1, None) == EnginePlacement(0, True, COLOCATED_MEMORY)
    assert place_engine({0}, 1, 0.45) == EnginePlacement(0, True, 0.45)
    # two: the one the trainer leaves, most of it
    assert place_engine({0}, 2, None) == EnginePlacement(1, False, OWN_GPU_MEMORY)
    assert place_engine({1}, 2, None) == EnginePlacement(0, False, OWN_GPU_MEMORY)
    # ranks on cuda:0..1 of 3 GPUs: the third; on all of them: the first rank's, shared
    assert place_engine({0, 1}, 3, None) == EnginePlacement(2, False, OWN_GPU_MEMORY)
    assert place_engine({0, 1}, 2, None) == EnginePlacement(0, True, COLOCATED_MEMORY)
    # the trainer on the CPU of a GPU worker (devices.policy 'cpu'): the first card is the server's own
    assert place_engine(set(), 2, None) == EnginePlacement(0, False, OWN_GPU_MEMORY)
    assert place_engine({0}, 1, None).describe() == "on GPU 0 (shared with the trainer, asleep while it trains), 30% of its memory"


def _server(placement: EnginePlacement, extra: tuple[str, ...] = ()) -> VLLMServer:
    return VLLMServer(ServerConfig(python=Path("/venv/bin/python"), model_dir=Path("/m"), dtype="bfloat16",
                                   max_model_len=1024, lora_rank=8, log_path=Path("/tmp/v.log"), extra_args=extra,
                                   placement=placement))


@pytest.mark.parametrize("visible, expected", [(None, "1"), ("4,6", "6"), ("GPU-aa, GPU-bb", "GPU-bb")])
def test_the_server_sees_its_one_card_by_the_workers_own_numbering(monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    server = _server(EnginePlacement(1, False, 0.85))
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == expected
    command = server.command()
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.85"
    assert command[command.index("--dtype") + 1] == "bfloat16"


def test_a_cpu_server_keeps_the_workers_devices_and_vllms_memory_flags(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    server = _server(EnginePlacement(None, False, None))
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == ""
    assert "--gpu-memory-utilization" not in server.command()


def test_a_cpu_server_takes_the_trainers_thread_count_and_a_gpu_server_vllms_own(monkeypatch):
    """On the CPU, one process: its OpenMP pool would otherwise take every core whatever the job's share. On a
    GPU, or with the admin's executor (vLLM then sizes and binds its worker processes' threads), none is set."""
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the trainer's own setting never passes as such
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert _server(EnginePlacement(None, False, None)).environment()["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in _server(EnginePlacement(0, False, 0.85)).environment()
    spread = _server(EnginePlacement(None, False, None), ("--distributed-executor-backend", "mp"))
    assert "OMP_NUM_THREADS" not in spread.environment()
    assert "uni" not in spread.command()


def test_the_admins_share_in_grpo_vllm_args_is_read_and_replaced_by_one_flag():
    args = ("--max-num-seqs", "64", "--gpu-memory-utilization", "0.5", "--gpu-memory-utilization=0.6", "--x")
    assert option_value(args, "--gpu-memory-utilization") == "0.6"  # the last, as vLLM's parser takes it
    assert without_option(args, "--gpu-memory-utilization") == ("--max-num-seqs", "64", "--x")
    assert option_value(("--max-num-seqs", "64"), "--gpu-memory-utilization") is None
