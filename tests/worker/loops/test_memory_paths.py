"""The memory-saving paths learn exactly what the plain ones do: log-probs through the chunked
head against the full logits, token-budget micro-batches against row ones, gradient checkpointing
against none. Same spec, same seed: the same metrics to float32's rounding (the spec names float32: under
bfloat16 base weights each path rounds differently)."""

import json

import pytest
import torch

from service.core.specs import GRPOJob, TracInJob
from worker.batch import RolloutBatch
from worker.loops import grpo, tracin
from worker.model import forward
from worker.model.forward import micro_batches
from worker.reporting import FileReporter

BASE = {
    "model": {"name": "tiny-random-llama", "dtype": "float32", "lora": {"r": 4, "dropout": 0.0}},
    "dataset": {"name": "arith", "num_train": 40, "num_val": 4},
    "rewards": [{"name": "digit_share"}],
    "grpo": {"steps": 3, "prompts_per_step": 3, "num_generations": 4, "max_new_tokens": 12,
             "learning_rate": 1e-3, "micro_batch_size": 12, "eval_prompts": 2, "samples_per_step": 0,
             "kl_coef": 0.05, "epochs_per_rollout_batch": 2},
}
COMPARED = ("reward/mean", "loss/total", "loss/policy", "kl", "grad_norm", "entropy", "eval/accuracy")


def _merge(base: dict, over: dict) -> dict:
    out = json.loads(json.dumps(base))
    for k, v in over.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def _metrics(spec, tmp_path, name, settings, loop=grpo):
    out = tmp_path / name
    loop.run(spec, FileReporter(out), settings=settings)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same(a, b):
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b, strict=True):
        for k in COMPARED:
            if k in x["metrics"]:
                assert y["metrics"][k] == pytest.approx(x["metrics"][k], rel=1e-4, abs=1e-6), (x["step"], k)


@pytest.mark.parametrize("full_ft", [False, True])
def test_chunked_head_learns_what_the_full_logits_learn(tmp_path, settings_factory, digit_reward, monkeypatch, full_ft):
    d = _merge(BASE, {"model": {"lora": None}} if full_ft else {})
    spec = GRPOJob.model_validate(d)
    chunked = _metrics(spec, tmp_path, "chunked", settings_factory())
    monkeypatch.setattr(forward, "split_head", lambda model: None)  # every model takes the full-logits path
    full = _metrics(spec, tmp_path, "full", settings_factory())
    _assert_same(full, chunked)


@pytest.mark.parametrize(("base", "over"), [
    ({}, {"grpo": {"micro_batch_tokens": 40}}),
    ({}, {"model": {"gradient_checkpointing": True}}),
    ({"model": {"lora": None}}, {"model": {"lora": None, "gradient_checkpointing": True}}),  # and a KL reference copy
], ids=["token-budget", "checkpointing", "checkpointing-full-ft"])
def test_memory_options_learn_what_the_defaults_learn(tmp_path, settings_factory, digit_reward, base, over):
    plain = _metrics(GRPOJob.model_validate(_merge(BASE, base)), tmp_path, "plain", settings_factory())
    saved = _metrics(GRPOJob.model_validate(_merge(BASE, over)), tmp_path, "saved", settings_factory())
    _assert_same(plain, saved)


@pytest.mark.parametrize("over", [{"grpo": {"micro_batch_tokens": 40}}, {"model": {"gradient_checkpointing": True}}],
                         ids=["token-budget", "checkpointing"])
def test_tracin_influence_is_the_same_with_the_memory_options(tmp_path, settings_factory, digit_reward, over):
    """The ghost hooks see each micro-batch's activations once per backward, recomputed or not."""
    d = _merge(BASE, {"kind": "tracin", "tracin": {"val_prompts": 2}})
    plain = _metrics(TracInJob.model_validate(d), tmp_path, "plain", settings_factory(), loop=tracin)
    budget = _metrics(TracInJob.model_validate(_merge(d, over)), tmp_path, "budget", settings_factory(), loop=tracin)
    _assert_same(plain, budget)
    for x, y in zip(plain, budget, strict=True):
        for k in (k for k in x["metrics"] if k.startswith("tracin/") and not k.endswith("_s")):
            assert y["metrics"][k] == pytest.approx(x["metrics"][k], rel=1e-4, abs=1e-6), k


def _batch(prompt_lens, completion_lens):
    N, P, T = len(prompt_lens), max(prompt_lens), max(completion_lens)
    pm = torch.tensor([[0] * (P - p) + [1] * p for p in prompt_lens])
    cm = torch.tensor([[1] * c + [0] * (T - c) for c in completion_lens])
    return RolloutBatch(prompt_ids=pm.clone(), prompt_mask=pm, completion_ids=cm.clone(), completion_mask=cm,
                        truncated=torch.zeros(N, dtype=torch.bool), completions=[""] * N)


def test_micro_batches_pack_rows_up_to_the_token_budget():
    b = _batch([4, 4, 2, 2, 4], [6, 2, 2, 30, 2])  # row widths 10, 6, 4, 32, 6
    rows = list(range(5))
    assert micro_batches(b, rows, max_rows=2) == [[0, 1], [2, 3], [4]]
    # 2 rows x (4 + 6) = 20 fits; a third would pad to 3 x 10; row 3 alone is over the budget
    assert micro_batches(b, rows, max_rows=8, max_tokens=20) == [[0, 1], [2], [3], [4]]
    assert micro_batches(b, rows, max_rows=8, max_tokens=30) == [[0, 1, 2], [3], [4]]
    assert micro_batches(b, rows, max_rows=2, max_tokens=1000) == [[0, 1], [2, 3], [4]]
    shuffled = micro_batches(b, rows, max_rows=8, max_tokens=30, shuffle_seed=1)
    assert sorted(r for mb in shuffled for r in mb) == rows
