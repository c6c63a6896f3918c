import json

import pytest
import torch
from safetensors.torch import load_file

from service.core.specs import JointJob, RetrieverSpec
from worker.loops import joint
from worker.model.checkpoints import STATE_FILE
from worker.reporting import FileReporter
from worker.retriever import load_retriever


def _spec(**retriever):
    return {"kind": "joint", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
            "retriever": {"name": "tiny-random-bert", "k": 3, "candidates": 6, "learning_rate": 1e-2,
                          "kl_coef": 0.1, **retriever},
            "dataset": {"name": "persona-facts", "corpus_size": 12, "num_val": 6}, "rewards": [{"name": "digit_share"}],
            "grpo": {"steps": 3, "prompts_per_step": 2, "num_generations": 3, "max_new_tokens": 6,
                     "eval_prompts": 4, "samples_per_step": 6}}


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _initial_retriever(spec):
    return {k: v.clone() for k, v in load_retriever(spec.retriever, device="cpu", seed=spec.grpo.seed).state_dict().items()}


def test_retriever_trains_against_a_frozen_reference(tmp_path, settings_factory, digit_reward):
    spec = JointJob.model_validate(_spec())
    joint.run(spec, FileReporter(tmp_path), settings=settings_factory())
    metrics = {m["step"]: m["metrics"] for m in _lines(tmp_path / "metrics.jsonl")}
    for key in ("retriever/reward_mean", "retriever/loss", "retriever/kl", "retriever/entropy",
                "retriever/advantage_abs_mean", "retriever/gold_recall"):
        assert key in metrics[3], key
    assert "eval/retriever_recall_at_1" in metrics[0] and "eval/retriever_recall_at_1" in metrics[3]
    # the retriever moved; the KL to the reference is non-zero, so the reference did not move with it
    saved = load_file(tmp_path / "checkpoints" / "step-3" / "retriever.safetensors")
    init = _initial_retriever(spec)
    assert any(not torch.equal(saved[k], init[k]) for k in init if k in saved)
    assert metrics[3]["retriever/kl"] > 0
    samples = _lines(tmp_path / "samples.jsonl")
    assert all(s["extra"]["doc_id"].startswith(("person-", "profile-")) for s in samples)


def test_the_retriever_follows_the_policys_schedule(tmp_path, settings_factory, digit_reward):
    """One optimizer step for both: with a cosine schedule and warm-up, the retriever's learning rate
    is retriever.learning_rate times the policy's factor at every step, and resumes with it."""
    d = _spec()
    d["grpo"].update(lr_schedule="cosine", warmup_steps=1, learning_rate=1e-3, steps=3)
    joint.run(JointJob.model_validate(d), FileReporter(tmp_path), settings=settings_factory())
    state = torch.load(tmp_path / "checkpoints" / "step-3" / STATE_FILE, weights_only=False)
    assert state["schedulers"]["retriever"]["last_epoch"] == state["schedulers"]["policy"]["last_epoch"] > 0
    policy_lr = state["optimizers"]["policy"]["param_groups"][0]["lr"]
    retriever_lr = state["optimizers"]["retriever"]["param_groups"][0]["lr"]
    assert retriever_lr == pytest.approx(1e-2 * policy_lr / 1e-3)


def test_generator_only_keeps_the_retriever(tmp_path, settings_factory, digit_reward):
    spec = _spec(generator_only=True)
    for knob in ("learning_rate", "kl_coef"):  # a frozen retriever refuses its training knobs
        del spec["retriever"][knob]
    spec = JointJob.model_validate(spec)
    joint.run(spec, FileReporter(tmp_path), settings=settings_factory())
    saved = load_file(tmp_path / "checkpoints" / "step-3" / "retriever.safetensors")
    init = _initial_retriever(spec)
    assert all(torch.equal(saved[k], init[k]) for k in init if k in saved)
    metrics = {m["step"]: m["metrics"] for m in _lines(tmp_path / "metrics.jsonl")}
    assert "retriever/loss" not in metrics[2] and "retriever/gold_recall" in metrics[2]


def test_joint_job_through_the_api(sqlite_api, digit_reward):
    api = sqlite_api
    jid = api.run_job(_spec())
    latest = api.get(f"/v1/jobs/{jid}/metrics/latest").json()
    assert "retriever/gold_recall" in latest and "eval/retriever_recall_at_1" in latest
    assert api.get(f"/v1/jobs/{jid}/samples").json()[0]["extra"]["doc_id"].startswith(("person-", "profile-"))


def test_one_document_cannot_train_a_retriever():
    with pytest.raises(ValueError, match="k must be >= 2"):
        RetrieverSpec(k=1)
    assert RetrieverSpec(k=1, generator_only=True).k == 1


@pytest.mark.slow
@pytest.mark.long
def test_retriever_learns_from_the_generators_rewards(tmp_path, settings_factory):
    """MiniLM starts by preferring the distractor profiles (they repeat the question's words);
    only the fact documents let SmolLM2 answer, so the rewards teach the retriever to rank them first."""
    from pathlib import Path

    import yaml

    spec = yaml.safe_load((Path(__file__).parents[3] / "examples" / "joint-smollm2.yaml").read_text())
    spec["grpo"].update(steps=5, eval_every=5, samples_per_step=0)
    # the generator in float32, as this bound was set on: with bfloat16 base weights one run rose 0.375 -> 0.5
    spec["model"]["dtype"] = "float32"
    joint.run(JointJob.model_validate(spec), FileReporter(tmp_path), settings=settings_factory())
    metrics = {m["step"]: m["metrics"] for m in _lines(tmp_path / "metrics.jsonl")}
    start, end = metrics[0]["eval/retriever_recall_at_1"], metrics[5]["eval/retriever_recall_at_1"]
    assert start <= 0.5 and end >= start + 0.3, (start, end)


def test_joint_drops_queries_and_document_groups_with_no_signal(tmp_path, settings_factory, monkeypatch):
    """A reward that ties for every answer to some questions: with drop_zero_std_groups those
    queries are replaced by fresh ones, so every kept query's k * G rewards carry signal."""
    from service.core import reward_specs
    from worker import rewards as R

    def some_questions_tie(completion, answers):
        return 0.5 if len(answers[0]) % 2 else len(set(completion)) / 10

    monkeypatch.setitem(R.REGISTRY, "some_tie", R.RewardInfo(some_questions_tie))
    monkeypatch.setitem(reward_specs.BUILTIN_REWARDS, "some_tie", "ties on some questions (tests)")
    spec = _spec()
    spec["rewards"] = [{"name": "some_tie"}]
    spec["grpo"].update(steps=2, prompts_per_step=3, samples_per_step=64, drop_zero_std_groups=True,
                        max_refill_rounds=8)
    joint.run(JointJob.model_validate(spec), FileReporter(tmp_path), settings=settings_factory())
    metrics = {m["step"]: m["metrics"] for m in _lines(tmp_path / "metrics.jsonl")}
    assert any(metrics[s]["rollout/refill_rounds"] > 0 for s in (1, 2))
    assert any(metrics[s]["frac_reward_zero_std"] > 0 for s in (1, 2))
    k, G = 3, 3
    for step in (1, 2):
        rewards = [x["reward"] for x in _lines(tmp_path / "samples.jsonl") if x["step"] == step]
        assert rewards and len(rewards) % (k * G) == 0
        queries = [rewards[i:i + k * G] for i in range(0, len(rewards), k * G)]
        assert all(max(q) > min(q) for q in queries), queries


def test_a_cancelled_joint_job_says_so_once(tmp_path, settings_factory, digit_reward):
    class StopAfterOne(FileReporter):
        def should_stop(self):
            return (self.out / "metrics.jsonl").exists() and len(_lines(self.out / "metrics.jsonl")) >= 2

    result = joint.run(JointJob.model_validate(_spec()), StopAfterOne(tmp_path), settings=settings_factory())
    assert (result.status, result.step) == ("cancelled", 1)
    events = [e["type"] for e in _lines(tmp_path / "events.jsonl")]
    # the loop checkpoints and says it is stopping; the runner records the one `cancelled`
    assert events.count("stopping") == 1 and "cancelled" not in events
    assert (tmp_path / "checkpoints" / "step-1" / "retriever.safetensors").exists()
