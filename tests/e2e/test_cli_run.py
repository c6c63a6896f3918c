"""`grpo-jobs run SPEC --out DIR` on every shipped minimal example: the files the contract promises."""

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import BIN

EXAMPLES = Path(__file__).parents[2] / "examples"


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("name", ["grpo-minimal", "tracin-minimal", "joint-minimal", "sparsity-minimal"])
def test_run_writes_the_contract_files(tmp_path, models_root, name):
    out = tmp_path / "out"
    env = {"GRPO_DATA_DIR": str(tmp_path / "data"), "GRPO_MODELS_ROOT": str(models_root), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([str(BIN), "run", str(EXAMPLES / f"{name}.yaml"), "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    metrics = _lines(out / "metrics.jsonl")
    assert all(set(m) == {"step", "metrics"} for m in metrics)
    steps = [m["step"] for m in metrics if "reward/mean" in m["metrics"]]
    total = 4 if name == "sparsity-minimal" else 3
    assert steps == list(range(1, total + 1))
    types = [e["type"] for e in _lines(out / "events.jsonl")]
    assert types[-1] == "succeeded"
    last = out / "checkpoints" / f"step-{total}"
    import yaml

    lora = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())["model"].get("lora")
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (last / weights).exists() and (last / "trainer_state.pt").exists()
    if name == "tracin-minimal":
        assert [s["step"] for s in _lines(out / "selections.jsonl")] == [1, 2, 3]
    if name == "sparsity-minimal":
        assert {(s["step"], s["scope"]) for s in _lines(out / "sparsity.jsonl")} == {
            (2, "window"), (2, "cumulative"), (4, "window"), (4, "cumulative")}
    if name == "joint-minimal":
        assert (last / "retriever.safetensors").exists()


def test_run_rejects_a_bad_spec_with_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: grpo\ngrpo: {num_generations: 1}\n")
    r = subprocess.run([str(BIN), "run", str(bad), "--out", str(tmp_path / "o")], capture_output=True, text=True,
                       env={"GRPO_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "num_generations" in r.stderr
