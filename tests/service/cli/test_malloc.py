"""Training processes start with jemalloc preloaded where the machine has it."""

import json
import subprocess
import sys

import pytest
import yaml

from service.cli import malloc
from service.core.settings import Settings
from tests.e2e.conftest import run_env

needs_jemalloc = pytest.mark.skipif(malloc.jemalloc_library() is None, reason="no libjemalloc on this machine")


CUDA = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
ALWAYS = {**CUDA, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "64"}


def test_glibc_leaves_the_environment_as_it_is(monkeypatch):
    monkeypatch.setattr(malloc, "jemalloc_library", lambda: "libjemalloc.so.2")
    env = {"LD_PRELOAD": "libother.so", "X": "1"}
    assert malloc.training_env(Settings(GRPO_MALLOC="glibc"), env) == {**env, **ALWAYS}


def test_the_cuda_allocator_gets_one_setting_under_both_names():
    """Expandable segments unless the admin set either name: then theirs, under both (torch >= 2.9 reads
    PYTORCH_ALLOC_CONF first, a vLLM venv's own torch may read only the other)."""
    assert malloc.training_env(Settings(GRPO_MALLOC="glibc"), {}) == ALWAYS
    for name in CUDA:
        env = malloc.training_env(Settings(GRPO_MALLOC="glibc"), {name: "max_split_size_mb:512"})
        assert env == {**ALWAYS, **dict.fromkeys(CUDA, "max_split_size_mb:512")}


def test_the_cpu_kernel_caches_are_bounded_unless_the_admin_sized_them():
    """oneDNN's and ideep's caches of compiled matmul kernels, one per shape, grow a job's memory step after step
    at their default sizes (1,024 each): a training process starts with smaller ones, or the admin's."""
    env = malloc.training_env(Settings(GRPO_MALLOC="glibc"), {"LRU_CACHE_CAPACITY": "512"})
    assert env["LRU_CACHE_CAPACITY"] == "512" and env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128"


def test_jemalloc_is_preloaded_once_beside_what_was_there(monkeypatch):
    monkeypatch.setattr(malloc, "jemalloc_library", lambda: "libjemalloc.so.2")
    env = malloc.training_env(Settings(), {"LD_PRELOAD": "libother.so"})
    assert env["LD_PRELOAD"] == "libjemalloc.so.2 libother.so"
    assert malloc.training_env(Settings(), env) == env


def test_jemalloc_keeps_freed_pages_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(malloc, "jemalloc_library", lambda: "libjemalloc.so.2")
    assert malloc.training_env(Settings(), {})["MALLOC_CONF"] == "dirty_decay_ms:-1,muzzy_decay_ms:-1,lg_extent_max_active_fit:16"
    assert malloc.training_env(Settings(), {"MALLOC_CONF": "narenas:2"})["MALLOC_CONF"] == "narenas:2"
    assert "MALLOC_CONF" not in malloc.training_env(Settings(GRPO_KEEP_FREED_MEMORY=False), {})


def test_a_machine_without_jemalloc_trains_on_glibc(monkeypatch, caplog):
    monkeypatch.setattr(malloc, "jemalloc_library", lambda: None)
    assert malloc.training_env(Settings(), {"X": "1"}) == {"X": "1", **ALWAYS}
    assert "no libjemalloc" in caplog.text


def test_the_settings_name_only_known_allocators():
    with pytest.raises(ValueError, match="GRPO_MALLOC"):
        Settings(GRPO_MALLOC="tcmalloc")


@needs_jemalloc
@pytest.mark.parametrize(("choice", "expected"), [("jemalloc", "jemalloc"), ("glibc", "glibc, freed memory kept")])
def test_grpo_jobs_run_trains_under_the_chosen_malloc(tmp_path, models_root, choice, expected):
    spec = {"kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 2}},
            "dataset": {"name": "arith", "num_train": 8, "num_val": 2}, "rewards": [{"name": "numeric_match"}],
            "grpo": {"steps": 1, "prompts_per_step": 1, "num_generations": 2, "max_new_tokens": 4,
                     "eval_prompts": 1, "samples_per_step": 0}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = run_env(tmp_path, GRPO_MODELS_ROOT=str(models_root), GRPO_MALLOC=choice)
    subprocess.run([sys.executable, "-m", "service.cli", "run", str(tmp_path / "spec.yaml"), "--out",
                    str(tmp_path / "out")], check=True, capture_output=True, env=env, timeout=300)
    events = [json.loads(x) for x in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    loaded = next(e for e in events if e["type"] == "model_loaded")
    assert loaded["data"]["malloc"] == expected
