"""What each reward kind costs, and what the bundled judge is worth, measured side by side in one run.

1. Cost: one batch of real SmolLM2 completions on arith (P prompts x G, the demo's step) scored by
   each kind: numeric_match (a function), an http grader computing the same match (a uvicorn
   process on this machine), MiniLM similarity, a reward model (SmolLM2's weights with a
   sequence-classification head: the cost of a 135M reward model; its scores mean nothing) and the
   SmolLM2 judge; completions per second and the time as a share of one GRPO step on the same batch.
2. Agreement: the judge's P(yes) against numeric_match on `--auc-prompts` x G sampled completions:
   ROC AUC and accuracy at 0.5 (numeric_match is the truth on arith).
3. Equivalence: `--steps` steps of the demo spec with numeric_match, and again with the http grader;
   every metric but timings, step for step.

    python bench/rewards.py [--prompts 4] [--generations 8] [--auc-prompts 32] [--steps 3]

Ends with: RESULT <kind>_per_s=... <kind>_step_share=... judge_auc=... judge_acc=... http_equals_builtin=...
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from service.core.reward_specs import (
    HttpReward,
    JudgeReward,
    RewardModelReward,
    SimilarityReward,
)
from service.core.settings import Settings, get_settings
from service.core.specs import GRPOJob
from worker.loops.setup import build
from worker.loops.skeleton import Run
from worker.loops.sources import collect_train_rollouts
from worker.loops.update import train_epochs
from worker.reporting import FileReporter, Reporter
from worker.rewards import FunctionComponent, Item, Scorer, lookup
from worker.rewards.models import Judge, RewardModel, Similarity
from worker.rewards.remote import HttpGrader

GRADER = '''
from fastapi import FastAPI, Request
from worker.rewards.functions import numeric_match
app = FastAPI()
@app.post("/numeric")
async def numeric(request: Request):
    items = (await request.json())["items"]
    return {"scores": [numeric_match(it["completion"], it["answers"]) for it in items]}
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_grader() -> tuple[subprocess.Popen, str]:
    folder = Path(tempfile.mkdtemp(prefix="grpo-bench-grader-"))
    (folder / "bench_grader.py").write_text(GRADER)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "bench_grader:app", "--port", str(port),
                             "--log-level", "warning", "--app-dir", str(folder)])
    import httpx

    for _ in range(200):
        try:
            httpx.post(f"http://127.0.0.1:{port}/numeric", json={"items": []}, timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}/"


def demo_spec(args, rewards: list[dict], steps: int) -> dict:
    return {"kind": "grpo", "model": {"name": "smollm2-135m-instruct", "lora": {"r": 16, "alpha": 32}},
            "dataset": {"name": "arith", "difficulty": 1}, "rewards": rewards,
            "grpo": {"steps": steps, "prompts_per_step": args.prompts, "num_generations": args.generations,
                     "max_new_tokens": 24, "temperature": 0.8, "learning_rate": 3e-4, "micro_batch_size": 16,
                     "eval_prompts": 8, "samples_per_step": 0}}


def auc(scores: list[float], labels: list[bool]) -> float:
    """P(score of a positive > score of a negative), ties counting half."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--auc-prompts", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    base = get_settings()
    grader, url = start_grader()
    settings = Settings(GRPO_DATA_DIR=base.data_dir, GRPO_MODELS_ROOT=base.models_dir,
                        GRPO_MODEL_ROOTS=str(base.models_dir), GRPO_REWARD_URLS=url)
    try:
        # 1. cost, on one step's batch
        rep = Reporter()
        rep.checkpoint_root = Path(tempfile.mkdtemp(prefix="grpo-bench-rewards-"))
        s = build(GRPOJob.model_validate(demo_spec(args, [{"name": "numeric_match"}], 2)), settings, rep)
        run = Run(s, rep, evaluate=lambda step: {})
        collect_train_rollouts(s, 0, rep)  # warm-up
        t0 = time.perf_counter()
        ro = collect_train_rollouts(s, 1, rep)
        train_epochs(run, ro, None, None, 1)
        step_s = time.perf_counter() - t0
        items = [Item(ex.question, c, tuple(ex.answers)) for ex, c in
                 zip((ex for ex in ro.examples for _ in range(ro.group_size)), ro.batch.completions)]
        kinds = {
            "function": FunctionComponent("numeric_match", 1.0, lookup("numeric_match").fn),
            "http": HttpGrader(HttpReward(name="http", url=url + "numeric"), settings=settings, job_id=None),
            "similarity": Similarity.load(SimilarityReward(name="similarity"), settings=settings, device="cpu"),
            "reward_model": RewardModel.load(RewardModelReward(name="reward_model", model="smollm2-135m-instruct"),
                                             settings=settings, device="cpu"),
            "judge": Judge.load(JudgeReward(name="judge"), settings=settings, device="cpu"),
        }
        result = {}
        for name, comp in kinds.items():
            Scorer([comp]).score(items[:2], step=0)  # warm-up
            t0 = time.perf_counter()
            out = Scorer([comp]).score(items, step=1)
            dt = time.perf_counter() - t0
            assert not out.failures, out.failures
            result[f"{name}_per_s"] = len(items) / dt
            result[f"{name}_step_share"] = dt / step_s
            print(f"{name}: {len(items)} completions in {dt:.3f} s = {len(items) / dt:.1f}/s, "
                  f"{100 * dt / step_s:.1f}% of the {step_s:.1f} s step")

        # 2. the judge's agreement with numeric_match on sampled completions
        truth, judged = [], []
        for k in range(args.auc_prompts // args.prompts):
            ro = collect_train_rollouts(s, 100 + k, rep)
            its = [Item(ex.question, c, tuple(ex.answers)) for ex, c in
                   zip((ex for ex in ro.examples for _ in range(ro.group_size)), ro.batch.completions)]
            truth += [bool(lookup("numeric_match").fn(it.completion, it.answers)) for it in its]
            judged += Scorer([kinds["judge"]]).score(its, step=0).per_fn["judge"]
        result["judge_auc"] = auc(judged, truth)
        result["judge_acc"] = sum((j > 0.5) == t for j, t in zip(judged, truth)) / len(truth)
        print(f"judge vs numeric_match on {len(truth)} completions ({sum(truth)} correct): "
              f"AUC {result['judge_auc']:.3f}, accuracy at 0.5 {result['judge_acc']:.3f}")

        # 3. a run on the http grader equals the built-in run, step for step
        runs = {}
        for name, rewards in (("builtin", [{"name": "numeric_match"}]),
                              ("http", [{"name": "http", "url": url + "numeric", "tag": "numeric_match"}])):
            out = Path(tempfile.mkdtemp(prefix=f"grpo-bench-{name}-"))
            from worker.loops import grpo

            grpo.run(GRPOJob.model_validate(demo_spec(args, rewards, args.steps)), FileReporter(out), settings=settings)
            runs[name] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        same = all(a["step"] == b["step"] and all(
            abs(v - b["metrics"][k]) <= 1e-6 * max(1.0, abs(v)) for k, v in a["metrics"].items()
            if not k.startswith(("time/", "throughput/")))
            for a, b in zip(runs["builtin"], runs["http"])) and len(runs["builtin"]) == len(runs["http"])
        result["http_equals_builtin"] = int(same)
        for a, b in zip(runs["builtin"], runs["http"]):
            m, n = a["metrics"], b["metrics"]
            print(f"step {a['step']}: reward/mean {m.get('reward/mean', float('nan')):.4f} vs "
                  f"{n.get('reward/mean', float('nan')):.4f}, eval/accuracy {m.get('eval/accuracy', float('nan')):.3f} "
                  f"vs {n.get('eval/accuracy', float('nan')):.3f}")
    finally:
        grader.terminate()
        grader.wait(timeout=10)
    print("RESULT " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
