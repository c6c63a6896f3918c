"""Our agent GRPO beside TRL's `GRPOTrainer(environment_factory=...)`, both from the same cold start: each
seed's SFT checkpoint (bench/learning.py --cold-start --keep) trained on by our GRPO run (already in the
folder) and by TRL 1.16 (bench/trl_agent.py, in TRL's own environment), in our bundled `multiplication`
environment with its MCP `calculator` tool, with the GRPO spec's settings. Prints each side's training
reward step by step over seeds, and the paired difference of their mean rewards.

    python bench/learning.py --cold-start bench/specs/cold-start-sft.yaml \\
        --spec bench/specs/cold-start-grpo.yaml --keep runs/cold          # ours, 6 seeds, runs kept
    make trl
    python bench/trl_agents.py --runs runs/cold --seeds 3                 # TRL from seeds 0..2's checkpoints

Matched: the model and adapter (LoRA r and alpha as the checkpoint's), prompts a step, group size,
temperature, learning rate (constant), clip, KL weight, gradient clipping, micro-batch, and the episode: up
to max_turns - 1 tool calls then an answer. TRL bounds a rollout by its completion (the model's turns and
the tool's answers): max_turns x max_new_tokens + (max_turns - 1) x max_observation_tokens. TRL draws its
own tasks (reset seeds from the seed, below the evaluation's) and samples with its own streams: the curves
compare learning, not draws. Our side's reward is the run's `reward/mean`, TRL's its logged `reward`.
Ends with: RESULT seeds=... ours_reward=... trl_reward=... diff=... lo=... hi=...
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
from pathlib import Path

import yaml
from learning import ROOT, mean_se  # bench/ is on the path when a bench runs

from service.core import evidence
from service.core.settings import get_settings
from service.core.specs import GRPOJob
from worker.environments.host import EVAL_SEEDS
from worker.environments.servers import BundledServer
from worker.model.checkpoints import latest_checkpoint
from worker.model.loading import smollm2_dir

TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


def ours(run: Path) -> list[float]:
    """Our GRPO run's training reward, step by step."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [m["metrics"]["reward/mean"] for m in lines if m["step"] > 0 and "reward/mean" in m["metrics"]]


def trl_task(spec: GRPOJob, seed: int, *, adapter: Path, url: str) -> dict:
    """What bench/trl_agent.py reads: the model, the adapter, the server, the tasks and the matched settings."""
    g, env = spec.grpo, spec.environment
    assert env is not None
    draw = random.Random(seed)
    return {
        "seed": seed, "model_dir": str(smollm2_dir(get_settings().models_dir)), "adapter_dir": str(adapter),
        "url": url, "seeds": [draw.randrange(EVAL_SEEDS) for _ in range(g.steps * g.prompts_per_step)],
        "matched": {"steps": g.steps, "prompts_per_step": g.prompts_per_step, "num_generations": g.num_generations,
                    "micro_batch_size": g.micro_batch_size, "temperature": g.temperature,
                    "learning_rate": g.learning_rate, "kl_coef": g.kl_coef, "clip_eps": g.clip_eps_low,
                    "max_grad_norm": g.max_grad_norm, "max_turns": env.max_turns,
                    "max_completion_length": env.max_turns * g.max_new_tokens
                    + (env.max_turns - 1) * env.max_observation_tokens},
    }


def run_trl(spec: GRPOJob, seed: int, adapter: Path, work: Path, threads: int) -> dict:
    """TRL's run of one seed from `adapter`, against a bundled server of its own; an earlier run's result
    kept in `work` is read instead (several seeds may run at once from separate invocations)."""
    if (kept := work / f"trl-{seed}-out.json").exists():
        return json.loads(kept.read_text())
    server = BundledServer("multiplication", work / f"server-{seed}.log")
    url = server.start()
    try:
        task, out = work / f"trl-{seed}.json", work / f"trl-{seed}-out.json"
        task.write_text(json.dumps(trl_task(spec, seed, adapter=adapter, url=url)))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TRL_EXPERIMENTAL_SILENCE": "1"}
        proc = subprocess.run([str(TRL_PYTHON), str(ROOT / "bench" / "trl_agent.py"), "--task", str(task), "--out",
                               str(out)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"TRL, seed {seed}, failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, required=True, help="bench/learning.py --cold-start --keep's folder")
    ap.add_argument("--seeds", type=int, default=3, help="seeds from --first-seed up")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="TRL's threads")
    ap.add_argument("--keep", type=Path, help="keep TRL's results here (trl-<seed>-out.json); those already there "
                    "are read, not run again")
    args = ap.parse_args()
    if not TRL_PYTHON.exists():
        raise SystemExit("TRL's environment is missing: run `make trl` first")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    curves: dict[str, dict[int, list[float]]] = {"ours": {}, "trl": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            spec = GRPOJob.model_validate(yaml.safe_load((args.runs / f"grpo-seed-{seed}.yaml").read_text()))
            adapter = latest_checkpoint(args.runs / f"sft-seed-{seed}" / "checkpoints")
            if adapter is None:
                raise SystemExit(f"{args.runs}/sft-seed-{seed} has no checkpoint")
            result = run_trl(spec, seed, adapter, work, args.threads)
            curves["trl"][seed] = result["reward"]
            print(f"seed {seed}: TRL " + " ".join(f"{r:.3f}" for r in curves["trl"][seed]) + "; tool calls a rollout "
                  + " ".join(f"{c:.2f}" for c in result["tool_calls"]) + f" ({result['versions']})", flush=True)
    for seed in seeds:  # read last: our runs may still have been running beside TRL's first seeds
        curves["ours"][seed] = ours(args.runs / f"grpo-seed-{seed}")
        print(f"seed {seed}: ours " + " ".join(f"{r:.3f}" for r in curves["ours"][seed]), flush=True)
    steps = min(len(c) for side in curves.values() for c in side.values())
    print(f"\ntraining reward by step, mean ± se over {len(seeds)} seeds (from {args.runs})")
    print("step  ours            TRL")
    for i in range(steps):
        o, t = (mean_se([curves[side][s][i] for s in seeds]) for side in ("ours", "trl"))
        print(f"{i + 1:<5} {o[0]:.3f} ± {o[1]:.3f}   {t[0]:.3f} ± {t[1]:.3f}")
    mean = {side: {s: statistics.fmean(curves[side][s][:steps]) for s in seeds} for side in curves}
    diff = evidence.mean_interval([mean["ours"][s] - mean["trl"][s] for s in seeds])  # None below 2 seeds
    shown = "diff=nan lo=nan hi=nan" if diff is None else \
        f"diff={diff.estimate:+.3f} lo={diff.low:+.3f} hi={diff.high:+.3f}"
    print(f"RESULT seeds={len(seeds)} steps={steps} ours_reward={statistics.fmean(mean['ours'].values()):.3f} "
          f"trl_reward={statistics.fmean(mean['trl'].values()):.3f} {shown}", flush=True)


if __name__ == "__main__":
    main()
