"""A GRPO job sampled by vLLM against the same job sampled by generate (GRPO_VLLM_PYTHON; `make vllm`)."""

import json

import pytest

from service.core.specs import GRPOJob
from worker.reporting import FileReporter
from worker.runner import loop_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MISMATCH_BOUND = 1e-3  # |engine - trainer| log-prob per token, fp32; measured up to 3.4e-5 on this model


def _metrics(out) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_step: dict[int, dict[str, float]] = {}
    for r in rows:
        by_step.setdefault(r["step"], {}).update(r["metrics"])
    return by_step


def _spec(engine: str) -> GRPOJob:
    return GRPOJob.model_validate({
        "model": {"name": "smollm2-135m-instruct", "lora": {"r": 8}},
        "dataset": {"name": "arith", "difficulty": 0},
        "rollout": {"engine": engine},
        "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 12, "temperature": 0.8,
                 "learning_rate": 3e-4, "eval_prompts": 8, "epochs_per_rollout_batch": 2, "loss": "cispo",
                 "clip_eps_high": 2.0},
    })


def test_a_vllm_job_matches_the_hf_job(tmp_path, settings_factory, vllm_python):
    results, metrics = {}, {}
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        settings = settings_factory(GRPO_VLLM_PYTHON=str(vllm_python))
        results[engine] = loop_for("grpo")(_spec(engine), FileReporter(out), settings=settings)
        metrics[engine] = _metrics(out)
    assert results["hf"].status == results["vllm"].status == "succeeded"
    hf, vllm = metrics["hf"], metrics["vllm"]
    # greedy evaluation of the same weights: the same answers from either engine
    assert vllm[0]["eval/accuracy"] == hf[0]["eval/accuracy"]
    assert abs(vllm[2]["eval/accuracy"] - hf[2]["eval/accuracy"]) <= 0.25
    for step in (1, 2):
        m = vllm[step]
        assert m["mismatch/logp_abs_max"] < MISMATCH_BOUND, m
        assert 0.99 < m["mismatch/ratio_p05"] <= m["mismatch/ratio_p50"] <= m["mismatch/ratio_p95"] < 1.01
        assert m["correction/changed_fraction"] == 0.0  # nothing near the cap of 2
        assert m["time/sync_s"] > 0 and "mismatch/logp_abs_mean" not in hf[step]
    events = [json.loads(line)["type"] for line in (tmp_path / "vllm" / "events.jsonl").read_text().splitlines()]
    assert "engine_started" in events and "engine_restarted" not in events
