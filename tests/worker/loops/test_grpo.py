import json

import pytest
import torch
from safetensors.torch import load_file

from service.core.specs import GRPOJob
from worker.loops import grpo
from worker.reporting import FileReporter


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("seed", "refill", "loss"), [(1, False, "grpo"), (0, True, "grpo"), (3, True, "grpo"),
                                                      (1, False, "gspo"), (1, False, "cispo")])
def test_learns_a_learnable_reward(tmp_path, settings_factory, digit_reward, seed, refill, loss):
    """The guard on learning itself: a configuration known to learn (0.1 -> 0.9 on every seed tried)
    must keep raising its training reward, with and without the demo's refill of tied groups, so a
    change to sampling, advantages, the loss or the update that slows learning fails here the day
    it lands (bench/learning.py measures the real model over many seeds)."""
    spec = GRPOJob.model_validate({
        "model": {"name": "tiny-random-llama"}, "dataset": {"name": "arith", "num_train": 200, "num_val": 8},
        "rewards": [{"name": "digit_share"}],
        "grpo": {"steps": 30, "prompts_per_step": 4, "num_generations": 8, "max_new_tokens": 8,
                 "learning_rate": 3e-3, "micro_batch_size": 32, "eval_prompts": 4, "seed": seed,
                 "samples_per_step": 0, "loss": loss, **({"drop_zero_std_groups": True, "max_refill_rounds": 1} if refill else {})},
    })
    grpo.run(spec, FileReporter(tmp_path), settings=settings_factory())
    rewards = [m["metrics"]["reward/mean"] for m in _metrics(tmp_path) if "reward/mean" in m["metrics"]]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3, (first, last)


def _run(spec_dict, out, settings, stop_after=None):
    spec = GRPOJob.model_validate(spec_dict)

    class Stopping(FileReporter):
        def should_stop(self):
            done = [m for m in _metrics(self.out) if m["step"] > 0] if (self.out / "metrics.jsonl").exists() else []
            return stop_after is not None and len(done) >= stop_after

    return grpo.run(spec, Stopping(out), settings=settings)


@pytest.mark.parametrize(("lora", "dtype", "prompts"), [(None, "float32", "uniform"), ({"r": 4}, "float32", "uniform"),
                                                      (None, "bfloat16", "uniform"), ({"r": 4}, "float32", "learnability")])
def test_resume_equals_straight_run(tmp_path, settings_factory, request, lora, dtype, prompts):
    """bf16 full fine-tuning too: its float32 master weights and moments are saved and restored in float32; and
    a learnability draw, whose posteriors the checkpoint holds, draws after a resume what a straight run draws
    (on 8 prompts, with a reward whose groups differ, so another draw would train other weights)."""
    spec = {"model": {"name": "tiny-random-llama", "lora": lora, "dtype": dtype}, "dataset": {"num_train": 50, "num_val": 4},
            "selection": {"prompts": prompts},
            "grpo": {"steps": 6, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6,
                     "learning_rate": 1e-2, "epochs_per_rollout_batch": 2, "micro_batch_size": 3,
                     "lr_schedule": "cosine", "warmup_steps": 1, "kl_coef": 0.05, "eval_prompts": 2}}
    if prompts == "learnability":
        request.getfixturevalue("digit_reward")
        spec |= {"rewards": [{"name": "digit_share"}], "dataset": {"num_train": 8, "num_val": 4},
                 "selection": {"prompts": prompts, "passed_at": 0.2}}
    settings = settings_factory()
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _run(spec, straight, settings).status == "succeeded"
    assert _run(spec, split, settings, stop_after=3).status == "cancelled"
    assert (split / "checkpoints" / "step-3").exists()
    assert _run(spec, split, settings).status == "succeeded"
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    a = load_file(straight / "checkpoints" / "step-6" / name)
    b = load_file(split / "checkpoints" / "step-6" / name)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)  # the same computation, resumed: bit for bit
    events = [json.loads(line)["type"] for line in (split / "events.jsonl").read_text().splitlines()]
    assert "resumed" in events


def test_lora_checkpoint_loads_with_peft(tmp_path, settings_factory):
    from peft import PeftModel

    from worker.model.loading import char_tokenizer, tiny_model

    spec = {"model": {"name": "tiny-random-llama", "lora": {"r": 4}}, "dataset": {"num_train": 20, "num_val": 2},
            "grpo": {"steps": 1, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4, "eval_prompts": 2}}
    _run(spec, tmp_path, settings_factory())
    base = tiny_model("tiny-random-llama", len(char_tokenizer()))
    loaded = PeftModel.from_pretrained(base, tmp_path / "checkpoints" / "step-1")
    assert any("lora_A" in n for n, _ in loaded.named_parameters())


@pytest.mark.slow
def test_one_real_step_on_smollm2_with_lora(tmp_path, settings_factory, digit_reward):
    spec = GRPOJob.model_validate({
        "model": {"name": "smollm2-135m-instruct", "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}},
        "dataset": {"name": "arith"}, "rewards": [{"name": "digit_share"}],
        "grpo": {"steps": 1, "prompts_per_step": 2, "num_generations": 3, "max_new_tokens": 12,
                 "learning_rate": 1e-3, "eval_prompts": 2, "kl_coef": 0.01},
    })
    settings = settings_factory()
    from worker.model.loading import load_policy

    model = load_policy(spec.model, models_root=settings.models_dir, device="cpu")[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    grpo.run(spec, FileReporter(tmp_path), settings=settings)
    after = load_file(tmp_path / "checkpoints" / "step-1" / "adapter_model.safetensors")
    changed = [k for k in after if not torch.equal(after[k], before[k.replace(".weight", ".default.weight")])]
    assert changed, "no LoRA parameter changed"
    step1 = next(m for m in _metrics(tmp_path) if m["step"] == 1)["metrics"]
    for key in ("reward/mean", "loss/total", "kl", "entropy", "grad_norm", "ratio/mean"):
        assert key in step1 and step1[key] == step1[key]  # present and not NaN
    assert step1["ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    # The share of the machine's measured peak each phase reached. Its size is a matter of timing (beside other
    # test processes, the peak measured at start and a phase's own matmuls see different shares of the cores:
    # 1.504 was seen in CI), so what is held is the count behind it: the rate times the phase's seconds is a
    # FLOP count between what the phase's tokens need at least and at most, at 2 FLOPs a parameter a token.
    peak = step1["mfu/peak_tflops"] * 1e12
    assert peak > 0 and step1["mfu/sampling"] > 0 and step1["mfu/train"] > 0, step1
    per_token, rows, completion = 2 * sum(p.numel() for p in model.parameters()), 2 * 3, step1["completions/mean_length"]
    prompt = 256  # the longest arith prompt in the chat template is under 100 tokens
    sampling_s = step1["time/rollout_s"] - step1["time/sync_s"] - step1.get("time/reward_s", 0.0)
    sampled = step1["mfu/sampling"] * peak * sampling_s
    assert per_token * rows * (completion - 1) <= sampled <= per_token * rows * (completion + prompt), step1
    trained = step1["mfu/train"] * peak * step1["time/train_s"]  # reference, forward, backward (LoRA: ~1 forward)
    assert 2 * per_token * rows * completion <= trained <= 4 * per_token * rows * (completion + prompt), step1
    # and the bytes sampling read, from its share of the read bandwidth: the weights at least once a position of
    # the longest completion, and at most that plus every row's cache (under a weights' worth a position here)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    read = step1["mbu/sampling"] * step1["mbu/peak_gbps"] * 1e9 * sampling_s
    assert weights * completion <= read <= weights * (spec.grpo.max_new_tokens + 1) * 2, step1


def test_kl_is_reported_only_when_measured(tmp_path, settings_factory, distinct_reward):
    """kl_coef 0: no reference pass and no `kl`, unless grpo.measure_kl asks for it; measuring
    it leaves the update unchanged (the first step's rewards differ, so it updates the adapter)."""
    spec = {"model": {"name": "tiny-random-llama", "lora": {"r": 4}}, "dataset": {"num_train": 20, "num_val": 2},
            "rewards": [{"name": "char_code"}],
            "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 3, "max_new_tokens": 5,
                     "learning_rate": 1e-2, "eval_prompts": 2}}
    settings = settings_factory()
    plain, measured = tmp_path / "plain", tmp_path / "measured"
    _run(spec, plain, settings)
    _run({**spec, "grpo": {**spec["grpo"], "measure_kl": True}}, measured, settings)
    assert all("kl" not in m["metrics"] for m in _metrics(plain))
    kls = [m["metrics"]["kl"] for m in _metrics(measured) if m["step"] > 0]
    assert len(kls) == 2 and kls[0] == pytest.approx(0.0, abs=1e-7) and kls[1] > 0  # the adapter starts as a no-op
    a = load_file(plain / "checkpoints" / "step-2" / "adapter_model.safetensors")
    b = load_file(measured / "checkpoints" / "step-2" / "adapter_model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k])


def test_a_skipped_last_step_still_evaluates(tmp_path, settings_factory, monkeypatch, constant_reward):
    """Every group ties (a constant reward), so every step is skipped; the evaluation due after the last
    step still runs and is the job's result, not the step-0 one carried over."""
    spec = GRPOJob.model_validate({"model": {"name": "tiny-random-llama", "lora": {"r": 4}},
                                   "dataset": {"num_train": 20, "num_val": 4}, "rewards": [{"name": "constant"}],
                                   "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 2,
                                            "max_new_tokens": 4, "eval_prompts": 2, "eval_every": 0}})
    result = grpo.run(spec, FileReporter(tmp_path), settings=settings_factory())
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "eval/accuracy" in m["metrics"]] == [0, 2]
    assert all(m["metrics"].get("frac_reward_zero_std") == 1.0 for m in lines if m["step"] > 0)
    assert result.eval == {k: v for m in lines if m["step"] == 2 for k, v in m["metrics"].items() if k.startswith("eval/")}


@pytest.mark.parametrize("dtype,fp32_head", [("bfloat16", False), ("bfloat16", True), ("float32", False),
                                            ("auto", False)])  # auto: as this machine decides
def test_the_first_epochs_ratio_is_exactly_one_whatever_the_dtype_and_batches(tmp_path, settings_factory, digit_reward,
                                                                              dtype, fp32_head):
    """Old log-probs are the first epoch's own forward (the policy's weights are the rollout copy's at the
    start of a step), so the ratio is 1 exactly before any update, even in bf16, whose log-probs move by
    up to 0.18 nats a token when a row is batched with other rows and padding. TracIn trains on a subset of
    the rows it sampled (one micro-batch: every epoch sees the same rows and padding); a learning rate no
    dtype can represent leaves the weights as they were, so both epochs' ratios are exactly 1."""
    from service.core.specs import TracInJob
    from worker.loops import tracin

    spec = TracInJob.model_validate({
        "model": {"name": "tiny-random-llama", "dtype": dtype, "lora": {"r": 4}, "fp32_head": fp32_head},
        "dataset": {"name": "arith", "num_train": 40, "num_val": 4}, "rewards": [{"name": "digit_share"}],
        "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 8, "eval_prompts": 2,
                 "epochs_per_rollout_batch": 2, "micro_batch_size": 32, "learning_rate": 1e-30},
        "tracin": {"selection": "top_fraction", "fraction": 0.5, "val_prompts": 2, "val_generations": 4,
                   "check_prediction": False}})
    tracin.run(spec, FileReporter(tmp_path), settings=settings_factory())
    steps = [m["metrics"] for m in _metrics(tmp_path) if m["step"] > 0]
    assert steps and all(m["ratio/max"] == 1.0 and m["ratio/mean"] == 1.0 for m in steps), steps


def _half_easy(completion, answers):
    """Every completion passes for a prompt whose answer's CRC-32 is even; a coin's worth pass for the rest."""
    import zlib

    if zlib.crc32(answers[0].encode()) % 2 == 0:
        return 1.0
    return float(zlib.crc32(completion.encode()) % 2)


def test_learnability_draws_fewer_groups_without_a_signal_than_uniform(tmp_path, settings_factory, monkeypatch):
    """On a task where about half the prompts are trivially solved (every group of them ties), a job with
    `selection.prompts: learnability` spends fewer of its later steps' groups on them than a uniform one, at
    no extra rollouts: a property of the draw, not of learning."""
    from service.core import reward_specs
    from worker import rewards as R

    monkeypatch.setitem(R.REGISTRY, "half_easy", R.RewardInfo(_half_easy))
    monkeypatch.setitem(reward_specs.BUILTIN_REWARDS, "half_easy", "half the prompts solved (tests)")
    tied = {}
    for prompts in ("uniform", "learnability"):
        spec = GRPOJob.model_validate({
            "model": {"name": "tiny-random-llama", "lora": {"r": 4}}, "dataset": {"num_train": 8, "num_val": 4},
            "rewards": [{"name": "half_easy"}], "selection": {"prompts": prompts},
            "grpo": {"steps": 12, "prompts_per_step": 8, "num_generations": 4, "max_new_tokens": 4,
                     "eval_every": 100, "eval_prompts": 2, "samples_per_step": 0}})
        out = tmp_path / prompts
        assert grpo.run(spec, FileReporter(out), settings=settings_factory()).status == "succeeded"
        steps = [m["metrics"] for m in _metrics(out) if m["step"] > 6]
        tied[prompts] = sum(m["frac_reward_zero_std"] for m in steps) / len(steps)
        assert all(m["selection/rollouts"] == 32 for m in steps)  # the same rollouts a step
        assert ("selection/predicted_signal" in steps[0]) == (prompts == "learnability")
    assert tied["learnability"] < tied["uniform"] - 0.15, tied
