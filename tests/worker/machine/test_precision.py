"""`model.dtype: auto`: the probe's choice, its cache, and a policy whose frozen base is bfloat16 while
everything that trains stays float32."""

from __future__ import annotations

import json

import pytest
import torch

from worker.machine import precision


def _timer(float32: float, bfloat16: float, calls: list):
    def timer(device, dtype, n):
        calls.append(dtype)
        return {torch.float32: float32, torch.bfloat16: bfloat16}[dtype]

    return timer


@pytest.mark.parametrize("rates,chosen", [((1e11, 6.4e11), "bfloat16"), ((1e11, 1.2e11), "float32"),
                                          ((1e11, 0.2e11), "float32")])
def test_auto_picks_bfloat16_only_where_it_is_native_and_asks_the_device_once(tmp_path, rates, chosen):
    cache, calls = tmp_path / "precision.json", []
    first = precision.choose("auto", torch.device("cpu"), cache=cache, timer=_timer(*rates, calls))
    assert (first.dtype, first.cached, first.probe.float32_flops, first.probe.bfloat16_flops) == (chosen, False, *rates)
    assert f"{rates[1] / rates[0]:.1f}x" in first.reason and calls == [torch.float32, torch.bfloat16]
    again = precision.choose("auto", torch.device("cpu"), cache=cache, timer=_timer(1.0, 1.0, calls))
    assert (again.dtype, again.cached, len(calls)) == (chosen, True, 2)  # from the machine's cache: no new timing
    assert precision.device_key(torch.device("cpu")) in json.loads(cache.read_text())


def test_a_named_dtype_or_a_reason_against_bfloat16_is_never_probed(tmp_path):
    calls: list = []
    timer = _timer(1e11, 9e11, calls)
    assert precision.choose("float64", torch.device("cpu"), cache=tmp_path / "p.json", timer=timer).dtype == "float64"
    fsdp = precision.choose("auto", torch.device("cpu"), cache=tmp_path / "p.json", timer=timer,
                            bfloat16_ok="resources.sharding 'fsdp' trains float32 weights only")
    assert fsdp.dtype == "float32" and "fsdp" in fsdp.reason and calls == []


@pytest.mark.parametrize("setting", ["float32", "bfloat16"])
def test_the_admins_auto_dtype_decides_a_spec_that_names_none_without_a_probe(tmp_path, settings_factory, monkeypatch,
                                                                              digit_reward, setting):
    """GRPO_AUTO_DTYPE: every worker of a fleet loads a spec with no dtype alike, whatever its CPU measures."""
    from service.core.specs import GRPOJob
    from worker.loops.setup import build
    from worker.reporting import FileReporter

    calls: list = []
    monkeypatch.setattr(precision, "matmul_flops", _timer(1e11, 6e11 if setting == "float32" else 0.5e11, calls))
    spec = GRPOJob.model_validate({
        "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
        "dataset": {"name": "arith", "num_train": 8, "num_val": 2}, "rewards": [{"name": "digit_share"}],
        "grpo": {"steps": 1, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4, "eval_prompts": 1}})
    assert spec.model.dtype == "auto"  # the default
    s = build(spec, settings_factory(GRPO_AUTO_DTYPE=setting), FileReporter(tmp_path))
    assert s.spec.model.dtype == setting and calls == []  # the setting, against what the probe would have said
    assert next(p for p in s.model.parameters() if not p.requires_grad).dtype == getattr(torch, setting)
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    [plan] = [e for e in events if e["type"] == "memory_plan"]
    assert plan["message"].startswith(f"auto: {setting}, as GRPO_AUTO_DTYPE names it")
    assert plan["data"]["precision"].items() >= {"dtype": setting, "auto": True, "probe": None}.items()


def test_a_torn_cache_is_measured_again_and_rewritten(tmp_path):
    cache, calls = tmp_path / "precision.json", []
    cache.write_text('{"half')
    assert precision.choose("auto", torch.device("cpu"), cache=cache, timer=_timer(1e11, 6e11, calls)).dtype == "bfloat16"
    assert len(calls) == 2 and json.loads(cache.read_text())


def test_the_real_probe_measures_both_dtypes():
    rates, cached = precision.probe(torch.device("cpu"), None)
    assert rates.float32_flops > 0 and rates.bfloat16_flops > 0 and not cached


def test_auto_on_a_native_device_trains_float32_adapters_over_a_bfloat16_base(tmp_path, settings_factory, monkeypatch,
                                                                              digit_reward):
    from service.core.specs import GRPOJob
    from worker.loops.setup import build
    from worker.reporting import FileReporter

    monkeypatch.setattr(precision, "matmul_flops", _timer(1e11, 6e11, []))  # a device where bfloat16 is native
    spec = GRPOJob.model_validate({
        "model": {"name": "tiny-random-llama", "dtype": "auto", "lora": {"r": 4}},
        "dataset": {"name": "arith", "num_train": 8, "num_val": 2}, "rewards": [{"name": "digit_share"}],
        "grpo": {"steps": 1, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4, "eval_prompts": 1}})
    s = build(spec, settings_factory(GRPO_AUTO_DTYPE="probe"), FileReporter(tmp_path))  # whatever the suite runs under
    assert s.spec.model.dtype == "bfloat16"
    frozen = {n: p for n, p in s.model.named_parameters() if not p.requires_grad}
    trained = [p for p in s.model.parameters() if p.requires_grad]
    matmuls = {n: p for n, p in frozen.items() if p.dim() == 2}  # the linear layers' and the embeddings' weights
    assert matmuls and all(p.dtype == torch.bfloat16 for p in matmuls.values())
    assert all(p.dtype == torch.float32 for n, p in frozen.items() if n not in matmuls)  # norms' scales
    assert trained and all(p.dtype == torch.float32 for p in trained)
    assert s.spec.model.activations == "float32"  # auto, on a CPU
    ids = torch.tensor([[3, 4, 5, 6]])
    out = s.model(input_ids=ids, output_hidden_states=True)
    assert all(h.dtype == torch.float32 for h in out.hidden_states)  # the residual stream between bfloat16 matmuls
    out.logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trained)
    assert any(p.grad.abs().sum() > 0 for p in trained)  # gradients reach the adapters through the bfloat16 base
    s.optimizer.step()
    assert all(v.dtype == torch.float32 for st in s.optimizer.state.values() for v in st.values() if v.dim())
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    [plan] = [e for e in events if e["type"] == "memory_plan"]
    assert plan["data"]["precision"]["dtype"] == "bfloat16" and plan["message"].startswith("auto: bfloat16")
    assert plan["data"]["precision"]["activations"] == "float32" and "float32 activations" in plan["message"]
    [fp] = [e["data"] for e in events if e["type"] == "fingerprint"]
    assert (fp["dtype"], fp["activations"]) == ("bfloat16", "float32")


@pytest.mark.parametrize("dtype,requested,device,acts", [
    ("bfloat16", "auto", "cpu", "float32"), ("bfloat16", "auto", "cuda", "weights"),
    ("float16", "weights", "cpu", "weights"), ("bfloat16", "float32", "cuda", "float32"),
    ("float32", "auto", "cpu", "weights"), ("float64", "auto", "cpu", "weights")])
def test_activations_are_float32_on_a_cpu_and_the_weights_dtype_elsewhere(dtype, requested, device, acts):
    assert precision.activations_for(requested, dtype, torch.device(device)) == acts


@pytest.mark.parametrize("activations,said", [("auto", "bfloat16 base weights, float32 activations; "),
                                               ("weights", "gradient checkpointing")])
def test_a_named_bfloat16_says_what_flows_between_its_matmuls(tmp_path, settings_factory, digit_reward, activations,
                                                            said):
    from service.core.specs import GRPOJob
    from worker.loops.setup import build
    from worker.reporting import FileReporter

    spec = GRPOJob.model_validate({
        "model": {"name": "tiny-random-llama", "dtype": "bfloat16", "activations": activations, "lora": {"r": 4}},
        "dataset": {"name": "arith", "num_train": 8, "num_val": 2}, "rewards": [{"name": "digit_share"}],
        "grpo": {"steps": 1, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4, "eval_prompts": 1}})
    build(spec, settings_factory(), FileReporter(tmp_path))
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    [plan] = [e for e in events if e["type"] == "memory_plan"]
    assert plan["message"].startswith(said)
    assert plan["data"]["precision"]["activations"] == ("float32" if activations == "auto" else "weights")
