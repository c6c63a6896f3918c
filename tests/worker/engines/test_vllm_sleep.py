"""A vLLM server on the trainer's GPU sleeps while the trainer trains and wakes with the new weights: the
engine's side of vLLM's sleep mode, against a stand-in server (tests/worker/engines/fake_vllm) since real
vLLM sleeps on CUDA only. The placement rules are in test_vllm_placement.py."""

import json
import sys
from pathlib import Path

import pytest

from service.core.specs import LoraSpec, ModelSpec
from worker.batch import SamplingParams
from worker.engines.vllm_engine import EnginePlacement, VLLMEngine
from worker.model.loading import load_policy

FAKE = Path(__file__).with_name("fake_vllm")
SHARED = EnginePlacement(0, True, 0.3)  # the trainer's GPU


@pytest.fixture
def calls(tmp_path, monkeypatch):
    """The stand-in server's requests so far, as (path, query, served model or adapter)."""
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    monkeypatch.setenv("FAKE_VLLM_CALLS", str(log))

    def read() -> list[tuple[str, str, str | None]]:
        lines = log.read_text().splitlines() if log.exists() else []
        log.write_text("")
        return [(c["path"], c["query"], c["model"] or c["lora_name"]) for c in map(json.loads, lines)]

    return read


def _engine(models_root, tmp_path, *, lora: bool, placement: EnginePlacement) -> tuple[VLLMEngine, object]:
    spec = ModelSpec(name="tiny-random-llama", lora=LoraSpec(r=4) if lora else None)
    policy, tok = load_policy(spec, models_root=models_root, device="cpu")
    engine = VLLMEngine(policy, tok, "cpu", SamplingParams(max_new_tokens=3), python=Path(sys.executable),
                        workdir=tmp_path / "engine", max_model_len=256, placement=placement, start_timeout_s=60)
    return engine, policy


def test_a_lora_server_sleeps_at_level_1_while_training_and_serves_the_next_weights_awake(models_root, tmp_path,
                                                                                          calls):
    engine, policy = _engine(models_root, tmp_path, lora=True, placement=SHARED)
    try:
        assert "--enable-sleep-mode" in engine.server.command()
        engine.sync(policy)
        engine.generate(["1+1="], 2, seeds=[0])
        assert calls() == [("/v1/load_lora_adapter", "", "v1"), ("/v1/completions", "", "v1"),
                           ("/v1/completions", "", "v1")]
        engine.rest()  # the trainer trains
        engine.rest()  # asleep already: nothing more
        assert calls() == [("/sleep", "level=1", None)]
        engine.sync(policy)  # the next step: awake, and the policy pushed again (after a wake, always)
        engine.generate(["1+1="], 1, seeds=[1])
        assert calls() == [("/wake_up", "", None), ("/v1/load_lora_adapter", "", "v2"),
                           ("/v1/unload_lora_adapter", "", "v1"), ("/v1/completions", "", "v2")]
        assert engine.last_wake_s > 0
    finally:
        engine.close()


def test_a_server_still_sampling_a_batch_ahead_stays_awake(models_root, tmp_path, calls, monkeypatch):
    """max_staleness 1: the next step's rows are sampled while the trainer trains, so no sleep then."""
    monkeypatch.setenv("FAKE_VLLM_DELAY_S", "1")
    engine, policy = _engine(models_root, tmp_path, lora=True, placement=SHARED)
    try:
        engine.sync(policy)
        ahead = engine.submit(["2+2="], 2, seeds=[0])
        engine.rest()
        assert len(ahead()) == 2
        assert ("/sleep", "level=1", None) not in calls() and not engine.asleep
    finally:
        engine.close()


def test_a_full_fine_tuning_server_sleeps_at_level_2_and_gets_the_weights_again(models_root, tmp_path, calls):
    engine, policy = _engine(models_root, tmp_path, lora=False, placement=SHARED)
    try:
        reload = [("/collective_rpc", "", None), ("/reset_prefix_cache", "", None)]
        engine.sync(policy)
        assert calls() == reload
        engine.rest()
        assert calls() == [("/sleep", "level=2", None)]  # level 2 drops the weights
        engine.sync(policy)  # unchanged, but dropped: reloaded
        assert calls() == [("/wake_up", "", None), *reload]
    finally:
        engine.close()


def test_a_server_on_a_gpu_of_its_own_never_sleeps(models_root, tmp_path, calls):
    engine, policy = _engine(models_root, tmp_path, lora=True, placement=EnginePlacement(1, False, 0.85))
    try:
        assert "--enable-sleep-mode" not in engine.server.command()
        engine.sync(policy)
        engine.rest()
        assert [c[0] for c in calls()] == ["/v1/load_lora_adapter"]
    finally:
        engine.close()
