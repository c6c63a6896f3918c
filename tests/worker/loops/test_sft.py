import json

import pytest
import torch
from safetensors.torch import load_file

from service.core.specs import GRPOJob, SFTJob
from worker.environments.servers import stop_servers
from worker.loops import sft
from worker.loops.setup import build
from worker.reporting import FileReporter


def _spec(lora=None, **over):
    return {"kind": "sft", "model": {"name": "tiny-random-llama", "lora": lora},
            "dataset": {"name": "arith", "difficulty": 0, "num_train": 40, "num_val": 8},
            "sft": {"steps": 6, "batch_size": 4, "micro_batch_size": 3, "max_new_tokens": 8, "eval_prompts": 4,
                    "learning_rate": 1e-2, "lr_schedule": "cosine", "warmup_steps": 1, "checkpoint_every": 3, **over}}


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class StopsAfter(FileReporter):
    def __init__(self, out, after=None):
        super().__init__(out)
        self.after = after

    def should_stop(self):
        done = [m for m in _metrics(self.out) if m["step"] > 0] if (self.out / "metrics.jsonl").exists() else []
        return self.after is not None and len(done) >= self.after


def test_first_step_loss_is_the_answer_tokens_cross_entropy(tmp_path, settings_factory):
    """loss/train of step 1 is the token-mean cross-entropy of the answers (and EOS) given the prompts,
    computed here from the model's full logits, one example at a time."""
    spec = SFTJob.model_validate(_spec())
    settings = settings_factory()
    assert sft.run(spec, FileReporter(tmp_path), settings=settings).status == "succeeded"
    s = build(spec, settings, FileReporter(tmp_path / "again"))  # the same initial weights (seeded)
    nll, tokens = 0.0, 0
    for ex in sft.step_examples(s, 1):
        prompt = s.tokenizer(sft.prompt_for(s, ex), add_special_tokens=False)["input_ids"]
        answer = s.tokenizer(ex.answers[0], add_special_tokens=False)["input_ids"] + [s.tokenizer.eos_token_id]
        with torch.no_grad():
            logits = s.model(input_ids=torch.tensor([prompt + answer])).logits[0].float()
        nll += float(torch.nn.functional.cross_entropy(logits[len(prompt) - 1:-1], torch.tensor(answer), reduction="sum"))
        tokens += len(answer)
    m = {x["step"]: x["metrics"] for x in _metrics(tmp_path)}
    assert m[1]["loss/train"] == pytest.approx(nll / tokens, rel=1e-5)
    assert m[1]["sft/answer_tokens"] == tokens
    assert m[6]["loss/train"] < m[1]["loss/train"]  # it learns
    assert {"loss/val", "eval/token_accuracy", "eval/accuracy", "eval/reward_mean"} <= m[0].keys() & m[6].keys()
    assert m[6]["loss/val"] < m[0]["loss/val"]
    # a step's share of the machine's measured peak: a real rate (tiny matmuls sit far below it)
    assert all(0 < m[k]["mfu/train"] < 1.5 and m[k]["mfu/peak_tflops"] > 0 for k in range(1, 7))


def test_batches_cover_the_train_split_once_per_pass(tmp_path, settings_factory):
    spec = SFTJob.model_validate(_spec(batch_size=8))
    s = build(spec, settings_factory(), FileReporter(tmp_path))
    seen = [ex.question for step in range(1, 6) for ex in sft.step_examples(s, step)]  # 40 = one pass
    assert sorted(seen) == sorted(ex.question for ex in s.task.train)
    assert [ex.question for ex in sft.step_examples(s, 6)] != seen[:8]  # the next pass has its own order


@pytest.mark.parametrize("lora", [None, {"r": 4}])
def test_resume_equals_straight_run(tmp_path, settings_factory, lora):
    settings = settings_factory()
    spec = SFTJob.model_validate(_spec(lora))
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert sft.run(spec, StopsAfter(straight), settings=settings).status == "succeeded"
    assert sft.run(spec, StopsAfter(split, after=3), settings=settings).status == "cancelled"
    assert sft.run(spec, StopsAfter(split), settings=settings).status == "succeeded"
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    a, b = load_file(straight / "checkpoints" / "step-6" / name), load_file(split / "checkpoints" / "step-6" / name)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)  # the same computation, resumed: bit for bit
    assert "resumed" in [json.loads(x)["type"] for x in (split / "events.jsonl").read_text().splitlines()]


def test_long_answers_are_cut_and_counted(tmp_path, settings_factory):
    spec = SFTJob.model_validate(_spec(steps=1, max_new_tokens=1))  # every answer is a digit and EOS: 2 tokens
    assert sft.run(spec, FileReporter(tmp_path), settings=settings_factory()).status == "succeeded"
    m = {x["step"]: x["metrics"] for x in _metrics(tmp_path)}[1]
    assert m["sft/truncated_ratio"] == 1.0 and m["sft/answer_tokens"] == 4


def test_sft_job_through_the_api(sqlite_api):
    api = sqlite_api
    jid = api.run_job(_spec({"r": 4}, steps=2, checkpoint_every=0) | {"sparsity": {"measure_interval": 1}})
    job = api.get(f"/v1/jobs/{jid}").json()
    assert (job["kind"], job["status"], job["total_steps"]) == ("sft", "succeeded", 2)
    latest = api.get(f"/v1/jobs/{jid}/metrics/latest").json()
    assert {"loss/train", "loss/val", "eval/token_accuracy", "sparsity/kl_task"} <= latest.keys()
    assert [c["step"] for c in api.get(f"/v1/jobs/{jid}/checkpoints").json()] == [2]
    reports = api.get(f"/v1/jobs/{jid}/sparsity").json()
    assert reports and reports[0]["report"]["precision"]["bf16"]


def test_sft_refuses_grpo_settings():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="num_generations"):
        SFTJob.model_validate(_spec(num_generations=4))
    with pytest.raises(ValidationError, match="grpo"):
        SFTJob.model_validate({**_spec(), "grpo": {"steps": 2}})


def test_sft_on_chat_rows(tmp_path, settings_factory):
    """`messages` rows: the conversation before the final assistant turn is the prompt, that turn the answer."""
    rows = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]}
            for w in ("yes", "no", "maybe", "ok") * 5]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    settings = settings_factory(GRPO_DATASETS_ROOT=tmp_path)
    spec = SFTJob.model_validate({**_spec(steps=4), "dataset": {"name": "jsonl", "path": "chat.jsonl", "num_val": 4},
                                  "rewards": [{"name": "exact_match"}]})
    assert sft.run(spec, FileReporter(tmp_path / "out"), settings=settings).status == "succeeded"
    m = {x["step"]: x["metrics"] for x in _metrics(tmp_path / "out")}
    assert m[4]["loss/train"] < m[1]["loss/train"] and m[4]["loss/val"] < m[0]["loss/val"]
    s = build(spec, settings, FileReporter(tmp_path / "again"))
    ex = sft.step_examples(s, 1)[0]
    batch = sft.encode(s, [ex])
    prompt = s.tokenizer.decode(batch.prompt_ids[0][batch.prompt_mask[0].bool()])
    assert prompt == f"User: {ex.question}\nAssistant:" and batch.completions == [ex.answers[0]]


def test_sft_on_demonstrations_trains_the_models_turns_and_evaluates_in_the_environment(tmp_path, settings_factory):
    """`dataset: env-demos`: the loss is the model's turns' (tool calls and answers), never the tool's answers
    between them; evaluation plays greedy episodes in the same environment."""
    spec = SFTJob.model_validate({
        "kind": "sft", "model": {"name": "tiny-random-llama", "chat_template": "chatml-tools", "lora": {"r": 8}},
        "dataset": {"name": "env-demos", "num_train": 16, "num_val": 4},
        "environment": {"name": "multiplication", "tools": "mcp", "max_turns": 2, "max_episode_tokens": 400,
                        "max_observation_tokens": 48, "eval_episodes": 2},
        "sft": {"steps": 4, "batch_size": 8, "learning_rate": 3e-3, "eval_every": 4, "max_new_tokens": 64,
                "val_batches": 1}})
    settings = settings_factory()
    assert sft.run(spec, FileReporter(tmp_path), settings=settings).status == "succeeded"
    metrics = {m["step"]: m["metrics"] for m in _metrics(tmp_path)}
    assert metrics[4]["loss/val"] < metrics[0]["loss/val"] and metrics[4]["loss/train"] < metrics[1]["loss/train"]
    assert {"eval/reward_mean", "eval/env/tool_calls_mean"} <= set(metrics[4])  # episodes, not prompts
    s = build(spec, settings, FileReporter(tmp_path / "again"))
    stop_servers()  # the environment build started for evaluation
    batch = sft.encode(s, s.task.train[:4])
    trained = [s.tokenizer.decode(batch.completion_ids[i][batch.loss_mask()[i].bool()]) for i in range(4)]
    assert all("<tool_call>" in t and "<tool_response>" not in t for t in trained)
    assert int(batch.loss_mask().sum()) < int(batch.completion_mask.sum())  # the tool's answers: context only

    # then GRPO from it, as `grpo-jobs run --init-from DIR` starts it: the SFT run's last adapter, named in an event
    grpo = GRPOJob.model_validate({
        "kind": "grpo", "model": {**spec.model.model_dump(exclude_none=True), "init_from": {"job": 1}},
        "environment": spec.environment.model_dump(exclude_none=True), "grpo": {"steps": 1, "prompts_per_step": 1}})
    started = FileReporter(tmp_path / "grpo", init_from=tmp_path)
    model = build(grpo, settings, started).model
    adapter = load_file(tmp_path / "checkpoints" / "step-4" / "adapter_model.safetensors")
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(adapter) and all(torch.equal(v, adapter[k]) for k, v in zip(sorted(adapter), (
        loaded[k] for k in sorted(loaded))))
    events = [json.loads(line) for line in (tmp_path / "grpo" / "events.jsonl").read_text().splitlines()]
    assert [e["data"] for e in events if e["type"] == "initialised"] == [{"job": 1, "step": 4, "source": str(tmp_path)}]
    with pytest.raises(ValueError, match="no complete checkpoint at step 3"):
        FileReporter(tmp_path / "x", init_from=tmp_path).init_checkpoint(1, 3)
