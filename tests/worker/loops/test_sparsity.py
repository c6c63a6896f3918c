import json

import pytest
import torch
from safetensors.torch import load_file

from service.core.specs import GRPOJob
from tests.numerics import bf16_attention_runs
from worker.algos.sparsity import diff_report
from worker.loops import grpo
from worker.loops.setup import build
from worker.reporting import FileReporter
from worker.sparsity_tracker import SparsityTracker

# full fine-tuning of a 2-layer model: every weight matrix is tracked
SPEC = {"kind": "grpo", "model": {"name": "tiny-random-llama"}, "dataset": {"num_train": 40, "num_val": 4},
        "rewards": [{"name": "digit_share"}],
        "grpo": {"steps": 4, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 16, "checkpoint_every": 2,
                 "learning_rate": 1e-3, "eval_prompts": 4},
        "sparsity": {"measure_interval": 2, "thresholds": [0.0, 1.0e-8, 1.0e-6, 1.0e-4], "quality": {"enabled": True}}}


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sparsity_job_end_to_end_matches_checkpoint_diff(tmp_path, settings_factory, digit_reward):
    spec = GRPOJob.model_validate(SPEC)
    grpo.run(spec, FileReporter(tmp_path), settings=settings_factory())
    reports = _lines(tmp_path / "sparsity.jsonl")
    assert [(r["step"], r["from_step"], r["scope"]) for r in reports] == [
        (2, 0, "window"), (2, 0, "cumulative"), (4, 2, "window"), (4, 0, "cumulative")]
    window = reports[2]["report"]
    assert {"per_layer", "per_component", "quality", "sign_flip_ratio", "sparsity_rtol"} <= window.keys()
    assert {"0", "1"} <= window["per_layer"].keys() and "q_proj" in window["per_component"]
    # an outside check: diff the saved checkpoints of the same window
    a = load_file(tmp_path / "checkpoints" / "step-2" / "model.safetensors")
    b = load_file(tmp_path / "checkpoints" / "step-4" / "model.safetensors")
    mine = diff_report(((k, a[k], b[k]) for k in a), thresholds=spec.sparsity.thresholds, rtol=spec.sparsity.rtol,
                       primary=spec.sparsity.primary_threshold)
    assert mine.numel == window["numel"]
    for t, v in mine.sparsity.items():
        assert window["sparsity"][t] == pytest.approx(v)
    q0 = next(q for q in window["quality"] if q["threshold"] == 0.0)
    assert q0["magnitude"]["kl"] == pytest.approx(0.0, abs=1e-6) and q0["magnitude"]["top1_agreement"] == 1.0
    assert window["precision"] == mine.precision.model_dump()  # fp32 and bf16 at the literature's tolerances
    metrics = {m["step"]: m["metrics"] for m in _lines(tmp_path / "metrics.jsonl")}
    assert metrics[4]["sparsity/ratio"] == reports[2]["sparsity"]
    assert "sparsity/sign_flip_ratio" in metrics[2]
    # KL to the starting policy on the task: the same in both scopes, > 0 once the weights moved
    kls = [(r["step"], r["scope"], r["report"]["kl_task"]) for r in reports]
    assert all(kl > 0 for _, _, kl in kls) and kls[0][2] == kls[1][2] and kls[2][2] == kls[3][2]
    assert metrics[4]["sparsity/kl_task"] == reports[3]["report"]["kl_task"]
    tokens = window["kl_task"] / window["kl_task_per_token"]  # completion tokens per completion, at most 16
    assert 1 <= tokens <= 16


@bf16_attention_runs
def test_quality_analysis_restores_weights_bit_for_bit(tmp_path, settings_factory):
    spec = GRPOJob.model_validate({
        "model": {"name": "tiny-random-qwen", "dtype": "bfloat16", "lora": {"r": 4}},
        "dataset": {"num_train": 20, "num_val": 4},
        "grpo": {"steps": 1, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4},
        "sparsity": {"measure_interval": 1, "quality": {"enabled": True, "probe_size": 2}}})
    rep = FileReporter(tmp_path)
    setup = build(spec, settings_factory(), rep)
    tracker = SparsityTracker(spec.sparsity, setup, rep)
    with torch.no_grad():
        for _, p in tracker.params:
            p.add_(torch.randn_like(p) * 0.01)
    before = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    tracker.measure(1)
    for n, p in setup.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert tracker.pop_metrics()["sparsity/ratio"] < 1.0
    window = _lines(tmp_path / "sparsity.jsonl")[0]["report"]
    # LoRA: the adapter factors, and the merged weight W0 + s*B@A the base model sees
    assert set(window["per_component"]) == {"lora_A", "lora_B"}
    assert "q_proj" in window["merged"]["per_component"] and window["merged"]["sparsity_primary"] < 1.0
