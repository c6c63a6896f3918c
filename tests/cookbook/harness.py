"""Running the scripts of tests/cookbook in tinker-cookbook's own environment (`make cookbook`) against a
running service, as a user's would: over HTTP, with the tokenizer from a local Hugging Face cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def hf_cache_with_smollm2(models_root: Path, root: Path) -> Path:
    """A Hugging Face cache holding the bundled SmolLM2's tokenizer under its hub name: the cookbook
    loads its tokenizer by that name, with no network."""
    from worker.model.loading import smollm2_dir

    repo = root / "hub" / f"models--{HUB_NAME.replace('/', '--')}"
    snapshot = repo / "snapshots" / "local"
    if snapshot.exists():
        return root
    source = smollm2_dir(models_root)
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("local")
    return root


def recipe_env(*, base: str, key: str, models_root: Path, root: Path, **knobs: str) -> dict[str, str]:
    """The environment a recipe runs in: the service's address and key, the local cache, the script's
    knobs (e.g. SL_SAVE_EVERY)."""
    return {**os.environ, "TINKER_BASE_URL": base, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0",
            "HF_HOME": str(hf_cache_with_smollm2(models_root, root / "hf")), "HF_HUB_OFFLINE": "1", **knobs}


def start_recipe(python: Path, script: str, log_dir: Path, steps: int, env: dict[str, str]) -> subprocess.Popen:
    """The script running in the background; its output in LOG_DIR.out."""
    out = log_dir.with_suffix(".out").open("a")
    return subprocess.Popen([str(python), str(HERE / script), str(log_dir), str(steps)], env=env, stdout=out,
                            stderr=subprocess.STDOUT)


def output(log_dir: Path) -> str:
    return log_dir.with_suffix(".out").read_text()[-6000:]


def recipe_metrics(log_dir: Path) -> list[dict]:
    """The cookbook's metrics.jsonl: a dict a step."""
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def check_rl_learning(metrics: list[dict], steps: int) -> None:
    """What the RL recipe (rl_arithmetic.py) shows over `steps` (3 or more) steps of 8 problems x 4 answers:
    SmolLM2-135M learns the format, to end its answer (<|im_end|> within 8 tokens), the 0.1 of the
    reward that is not correctness; and the sampler's log-probs are the trainer's."""
    per_step = [m for m in metrics if "env/all/format" in m]
    assert len(per_step) == steps, metrics
    fmt = [m["env/all/format"] for m in per_step]
    # measured: about 0.56 of the untrained model's answers end in time, 0.9 to 1.0 after one step. A step's
    # rate is 32 draws (sd about 0.08): a lucky first step (0.72 seen, then 0.94 and 0.78) leaves less than
    # 0.15 to gain, so a later rate of 0.85 or more, above the first, counts as learnt too
    later = sum(fmt[1:]) / (steps - 1)
    assert later >= fmt[0] + 0.15 or (later >= 0.85 and later > fmt[0]), fmt
    # the cookbook's own check: the KL between the sampler's and the trainer's log-probs
    assert all(abs(m["optim/kl_sample_train_v1"]) < 1e-3 for m in per_step), per_step
