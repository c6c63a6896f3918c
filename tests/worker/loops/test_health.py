"""The health guards in a real loop: a run that cannot learn is flagged at its first step (and
stopped when the spec asks), and a NaN gradient stops the job before the optimizer applies it,
with the last checkpoint before it intact."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from service.core.specs import GRPOJob, SFTJob
from worker.jobs.runner import loop_for
from worker.loops import skeleton, update
from worker.reporting import FileReporter
from worker.training import NonFiniteUpdate

TIED = {"model": {"name": "tiny-random-llama", "lora": {"r": 4}}, "dataset": {"name": "arith", "num_train": 40, "num_val": 4},
        "rewards": [{"name": "constant"}],  # every group's rewards tie (the constant_reward fixture)
        "grpo": {"steps": 4, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6, "eval_prompts": 2,
                 "checkpoint_every": 1}}


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _health(out):
    return [e["data"] for e in _lines(out / "events.jsonl") if e["type"] == "health"]


def test_a_run_whose_groups_all_tie_is_flagged_at_step_1_and_stops_when_asked(tmp_path, settings_factory,
                                                                               constant_reward):
    flagged = tmp_path / "flagged"
    loop_for("grpo")(GRPOJob.model_validate(TIED), FileReporter(flagged), settings=settings_factory())
    first = {(h["guard"], h["level"]) for h in _health(flagged) if h["step"] == 1}
    assert ("informative_groups", "critical") in first and ("update", "warn") in first
    assert ("update", "critical") in {(h["guard"], h["level"]) for h in _health(flagged) if h["step"] == 3}
    steps = {m["step"]: m["metrics"] for m in _lines(flagged / "metrics.jsonl")}
    assert [steps[s]["health/update"] for s in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 4.0]
    assert all(steps[s]["health/informative_groups"] == 0.0 for s in (1, 2, 3, 4))

    stopped = tmp_path / "stopped"
    spec = GRPOJob.model_validate({**TIED, "health": {"stop_on": ["informative_groups"]}})
    with pytest.raises(skeleton.HealthStop, match=r"step 1: informative_groups is 0.*health.stop_on"):
        loop_for("grpo")(spec, FileReporter(stopped), settings=settings_factory())
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["step-1"]  # the step recorded, kept
    assert max(m["step"] for m in _lines(stopped / "metrics.jsonl")) == 1


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_a_nan_gradient_stops_the_job_before_the_update_with_the_last_checkpoint_kept(tmp_path, settings_factory,
                                                                                      monkeypatch, digit_reward, kind):
    if kind == "grpo":
        spec = GRPOJob.model_validate({**TIED, "rewards": [{"name": "digit_share"}]})
    else:
        spec = SFTJob.model_validate({"model": TIED["model"], "dataset": TIED["dataset"],
                                      "sft": {"steps": 4, "batch_size": 4, "max_new_tokens": 6, "eval_prompts": 2,
                                              "checkpoint_every": 1}})
    before, seen = {}, {}
    real_step = update.optimizer_step

    def poisoned(run):  # step 2's gradient turns NaN after the backward, the loss stays finite
        if run.step == 2:
            seen["model"] = run.s.model
            before.update({n: p.detach().clone() for n, p in run.s.model.named_parameters() if p.requires_grad})
            next(p for p in run.s.model.parameters() if p.requires_grad).grad.view(-1)[0] = math.nan
        return real_step(run)

    monkeypatch.setattr(update, "optimizer_step", poisoned)
    with pytest.raises(NonFiniteUpdate, match="the gradient norm is nan at step 2"):
        loop_for(kind)(spec, FileReporter(tmp_path), settings=settings_factory())
    flags = _health(tmp_path)
    assert flags[-1]["guard"] == "non_finite" and flags[-1]["level"] == "critical" and flags[-1]["step"] == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    kept = load_file(tmp_path / "checkpoints" / "step-1" / "adapter_model.safetensors")
    assert kept and all(torch.isfinite(t).all() for t in kept.values())
    after = {n: p for n, p in seen["model"].named_parameters() if p.requires_grad}
    assert before and all(torch.equal(before[n], after[n]) for n in before)  # the optimizer never applied it
