from pathlib import Path

import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from service.core.specs import DATASETS, MODEL_PRESETS, JobSpec

ROOT = Path(__file__).parents[3]
SPEC = TypeAdapter(JobSpec)
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT.parent / "shared" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_examples_are_accepted(path):
    spec = SPEC.validate_python(yaml.safe_load(path.read_text()))
    assert spec.train.steps >= 1


def test_project_ships_the_shared_examples():
    own = {p.name for p in (ROOT / "examples").glob("*.yaml")}
    assert {"grpo-minimal.yaml", "tracin-minimal.yaml", "joint-minimal.yaml", "sparsity-minimal.yaml"} <= own


def test_defaults_are_documented():
    schema = SPEC.json_schema()
    for name, model in schema["$defs"].items():
        for field, prop in model.get("properties", {}).items():
            if field == "kind":
                continue
            assert "description" in prop or "$ref" in prop or "anyOf" in prop and any(
                "$ref" in a for a in prop["anyOf"]), f"{name}.{field} has no description"


def _err(spec: dict) -> str:
    with pytest.raises(ValidationError) as e:
        SPEC.validate_python(spec)
    return str(e.value)


@pytest.mark.parametrize("spec,needle", [
    ({"kind": "grpo", "grpo": {"num_generations": 1}}, "num_generations"),
    ({"kind": "tracin"}, "model.lora is required"),
    ({"kind": "tracin", "model": {"lora": {}}, "tracin": {"val_generations": 1}}, "val_generations"),
    ({"kind": "tracin", "model": {"lora": {}}, "tracin": {"score": "adam", "selection": "greedy"}},
     "tracin.score 'adam' works with selection positive or top_fraction"),
    ({"kind": "tracin", "model": {"lora": {}}, "tracin": {"score": "adam", "selection": "all"}},
     "tracin.score would have no effect"),
    ({"kind": "tracin", "model": {"lora": {}}, "tracin": {"score": "lbfgs"}}, "tracin.score"),
    ({"kind": "joint", "dataset": {"name": "arith"}}, "needs 'persona-facts' or 'jsonl'"),
    ({"kind": "grpo", "dataset": {"name": "file"}}, "dataset.train_file is required"),
    ({"kind": "grpo", "dataset": {"name": "file", "train_file": "data.jsonl"}}, "String should match pattern"),
    ({"kind": "grpo", "dataset": {"name": "arith", "train_file": "file-aaaaaaaaaaaaaaaaaaaaaaaa"}}, "dataset.train_file would have no effect"),
    ({"kind": "grpo", "rollout": {"correction": "masked"}}, "rollout.correction would have no effect"),
    ({"kind": "grpo", "rollout": {"engine": "vllm", "correction_cap": 1.0}}, "correction_cap"),
    ({"kind": "grpo", "rollout": {"engine": "sglang"}}, "rollout.engine"),
    ({"kind": "grpo", "rollout": {"max_staleness": 1}}, "rollout.max_staleness 1 needs rollout.engine 'vllm'"),
    ({"kind": "grpo", "rollout": {"engine": "vllm", "max_staleness": 2}}, "rollout.max_staleness"),
    ({"kind": "sft", "rollout": {"engine": "vllm", "max_staleness": 1}}, "kinds 'grpo' and 'tracin', not 'sft'"),
    ({"kind": "grpo", "grpo": {"loss": "ppo"}}, "grpo.loss"),
    ({"kind": "grpo", "rollout": {"engine": "vllm"}, "model": {"dtype": "float64"}}, "model.dtype"),
    ({"kind": "grpo", "rollout": {"engine": "vllm"}, "resources": {"processes": 2, "sharding": "fsdp"}},
     "resources.sharding 'fsdp'"),
    ({"kind": "grpo", "model": {"dtype": "bfloat16"}, "resources": {"processes": 2, "sharding": "fsdp"}},
     "needs float32 master weights"),
    ({"kind": "grpo", "dataset": {"name": "file", "train_file": "file-aaaaaaaaaaaaaaaaaaaaaaaa", "corpus_file": "file-aaaaaaaaaaaaaaaaaaaaaaaa"}}, "corpus_file would have no effect"),
    ({"kind": "grpo", "dataset": {"name": "file", "train_file": "file-aaaaaaaaaaaaaaaaaaaaaaaa", "path": "a.jsonl"}}, "dataset.path would have no effect"),
    ({"kind": "joint", "dataset": {"name": "file", "train_file": "file-aaaaaaaaaaaaaaaaaaaaaaaa"}}, "corpus_file is required"),
    ({"kind": "grpo", "dataset": {"accuracy": "vibes"}}, "dataset.accuracy"),
    ({"kind": "joint", "dataset": {"name": "jsonl", "path": "q.jsonl"}}, "corpus_path is required"),
    ({"kind": "grpo", "model": {"name": "/etc/passwd"}}, "model '/etc/passwd' is not available"),
    ({"kind": "grpo", "model": {"name": "~/x"}}, "model '~/x' is not available"),
    ({"kind": "grpo", "model": {"name": "a/../../b"}}, "model 'a/../../b' is not available"),
    ({"kind": "grpo", "dataset": {"name": "mnist"}}, "dataset.name"),
    ({"kind": "grpo", "rewards": [{"name": "vibes"}]}, "unknown reward 'vibes'"),
    ({"kind": "grpo", "grpo": {"num_generation": 4}}, "num_generation"),
    ({"kind": "grpo", "dataset": {"name": "jsonl", "path": "../etc/passwd"}}, "relative to the datasets root"),
    ({"kind": "grpo", "dataset": {"name": "jsonl"}}, "dataset.path is required"),
    ({"kind": "grpo", "devices": {"policy": "tpu:0"}}, "unknown device"),
    ({"kind": "grpo", "devices": {"rollout": "auto"}}, "devices.rollout"),  # 'auto' is the policy's: the worker places it
    ({"kind": "grpo", "rollout": {"gpu_memory_utilization": 0.5}}, "rollout.gpu_memory_utilization would have no effect"),
    ({"kind": "grpo", "model": {"dtype": "float32", "fp32_head": True}}, "model.fp32_head would have no effect: it applies only to a bfloat16"),
    ({"kind": "grpo", "model": {"dtype": "float32", "activations": "float32"}}, "model.activations would have no effect: it applies only to a bfloat16"),
    ({"kind": "grpo", "model": {"dtype": "bfloat16", "activations": "float64"}}, "model.activations"),
    ({"kind": "grpo", "rollout": {"engine": "vllm", "gpu_memory_utilization": 1.0}}, "rollout.gpu_memory_utilization"),
    ({"kind": "grpo", "rollout": {"engine": "vllm", "gpu_memory_utilization": 0}}, "rollout.gpu_memory_utilization"),
    ({"kind": "grpo", "grpo": {"prompts_per_step": 4}, "resources": {"nodes": 3}},
     "grpo.prompts_per_step (4) must be divisible by resources.nodes x processes (3 x 1 = 3)"),
    ({"kind": "grpo", "grpo": {"prompts_per_step": 4}, "resources": {"nodes": 2, "processes": 3}},
     "resources.nodes x processes (2 x 3 = 6)"),
    ({"kind": "grpo", "resources": {"nodes": 0}}, "resources.nodes"),
    ({"kind": "grpo", "resources": {"nodes": 65}}, "resources.nodes"),
    ({"kind": "grpo", "environment": {"name": "guess-number"}, "resources": {"nodes": 2}},
     "set resources.processes and resources.nodes to 1"),
    ({"kind": "grpo", "model": {"name": "smollm2-135m-instruct"}, "environment": {"name": "multiplication", "tools": "mcp"}},
     "smollm2-135m-instruct's own chat template cannot show tools to the model; set model.chat_template: chatml-tools"),
    ({"kind": "grpo", "environment": {"name": "calculator", "tools": "all"}}, "environment.tools"),
    ({"kind": "grpo", "environment": {"name": "calculator", "tools": []}}, "environment.tools"),
    ({"kind": "grpo", "environment": {"name": "calculator", "tools": [{"name": "1bad"}]}}, "environment.tools"),
    ({"kind": "grpo", "environment": {"name": "calculator", "tools": [{"name": "t", "parameters": {"type": "string"}}]}},
     "parameters must be a JSON schema of type 'object'"),
    ({"kind": "grpo", "model": {"chat_template": "llama3"}}, "model.chat_template"),
    ({"kind": "sft", "dataset": {"name": "env-demos"}}, "dataset.name 'env-demos' plays the job's environment"),
    ({"kind": "sft", "model": {"chat_template": "chatml-tools"}, "environment": {"name": "multiplication", "tools": "mcp"}},
     "set dataset.name to env-demos"),
    ({"kind": "sft", "model": {"chat_template": "chatml-tools"}, "dataset": {"name": "env-demos"},
      "environment": {"name": "guess-number", "tools": "mcp"}}, "set environment.name to one of them"),
    ({"kind": "grpo", "dataset": {"name": "env-demos"}, "environment": {"name": "calculator"}},
     "a GRPO job with an environment plays its own episodes"),
    ({"kind": "ppo"}, "kind"),
    ({"kind": "joint", "retriever": {"k": 8, "candidates": 4}}, "retriever.k must not exceed"),
])
def test_bad_specs_name_the_field(spec, needle):
    assert needle in _err(spec)


def test_names_known_to_the_worker():
    from worker.model.loading import TINY_PRESETS

    assert set(TINY_PRESETS) < set(MODEL_PRESETS)
    assert set(DATASETS) == {"arith", "file", "jsonl", "persona-facts", "env-demos"}


def test_a_job_on_several_machines_shares_a_step_among_all_their_ranks():
    spec = SPEC.validate_python({"kind": "grpo", "grpo": {"prompts_per_step": 8},
                                 "resources": {"nodes": 2, "processes": 2, "sharding": "fsdp"}})
    assert spec.resources.world == 4 and spec.gpus == 0  # each worker's own: `auto` runs anywhere
    # fsdp shards across the machines' ranks: one process on each of two nodes is enough
    assert SPEC.validate_python({"kind": "grpo", "resources": {"nodes": 2, "sharding": "fsdp"}}).resources.world == 2
    cuda = SPEC.validate_python({"kind": "grpo", "grpo": {"prompts_per_step": 8}, "devices": {"policy": "cuda"},
                                 "resources": {"nodes": 4, "processes": 2}})
    assert cuda.gpus == 2  # GPUs on each worker, not in all
