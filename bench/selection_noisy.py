"""Does any selection beat uniform GRPO where selection should matter? A task with mixed difficulty and
wrong reference answers on a share of the training prompts, a clean validation set, and a fixed
held-out test set the jobs never see; every arm on every seed starts from the same weights (checked).

The task (made here, seeded): sums of k one-digit numbers, k = 2, 3 or 4 ("Question: 3+8+1\\nAnswer:"
-> " 12"). The base model is a small Llama (4 layers, width 128, a character tokenizer) trained here
with plain next-token loss on clean sums until its greedy accuracy is about --base-acc, so that
pass rates spread over (0, 1): two-number sums are mostly right, four-number sums mostly wrong.
Training rows: --noise of them (default 30%) carry a wrong answer, the true sum moved by 1 to 3,
near misses the policy itself samples, so GRPO pays for a wrong answer. The validation file
(`dataset.val_path`, TracIn's validation batches) is clean; the test set (500 rows, disjoint from
training where the space allows) is evaluated outside the jobs, greedily, on the checkpoints.

Arms (`tracin.selection` and `tracin.score`): all (uniform GRPO), random (at the share positive-adam
kept on that seed), pass_rate (whole groups whose pass rate is nearest 0.5, at that share),
positive-sgd and positive-adam (`auto`'s AdamW geometry, `adam_fixed_state` when the results in docs/results.md were
measured and `adam_prior_state` since; the first step `sgd`). Reports per
arm: test accuracy at the last step and the area under the test curve (mean accuracy over the
checkpoints, trapezoid, the base model's at step 0 included), each as mean ± se and as a paired
difference against `all` with a 95% Student-t interval over seeds; for the influence arms, how well
"dropped" flags the wrong-label rows among the rows that carried a gradient (advantage != 0):
precision and recall, against the base rate.

    python bench/selection_noisy.py                       # 12 seeds, 50 steps, every arm
    python bench/selection_noisy.py --seeds 2 --steps 10 --parallel 2   # a quick look

A benchmark, never a test. Ends with one line per arm:
RESULT arm=... seeds=... acc=... acc_se=... diff=... lo=... hi=... auc=... auc_diff=... auc_lo=... auc_hi=...
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml
from learning import ROOT, RUN  # bench/ is on the path when a bench runs

sys.path.insert(0, str(ROOT))

from service.core import evidence  # noqa: E402

MODEL = "noisy-arith-base"
ARMS = {  # arm -> the tracin section's selection and score
    "positive-adam": {"selection": "positive", "score": "auto"},
    "positive-sgd": {"selection": "positive", "score": "sgd"},
    "random": {"selection": "random"},
    "pass_rate": {"selection": "pass_rate"},
    "all": {"selection": "all"},
}
INFLUENCE = ("positive-adam", "positive-sgd")
KEEPS_A_SHARE = ("random", "pass_rate")


# -- the task and the base model ---------------------------------------------------------------------

def question(rng: random.Random) -> tuple[str, int]:
    k = rng.choices((2, 3, 4), weights=(0.25, 0.4, 0.35))[0]
    xs = [rng.randrange(10) for _ in range(k)]
    return "+".join(map(str, xs)), sum(xs)


def wrong(answer: int, rng: random.Random) -> int:
    """A near miss: the sums the policy gets wrong are mostly off by a little."""
    return max(0, answer + rng.choice((-3, -2, -1, 1, 2, 3))) if answer > 3 else answer + rng.randint(1, 3)


@dataclass(frozen=True)
class Task:
    train: list[tuple[str, int, bool]]  # (question, the answer the row states, whether it is wrong)
    val: list[tuple[str, int]]
    test: list[tuple[str, int]]
    pretrain: list[tuple[str, int]]


def make_task(*, seed: int, n_train: int, n_val: int, n_test: int, noise: float) -> Task:
    rng = random.Random(seed)

    def draw(n: int, avoid: set[str]) -> list[tuple[str, int]]:
        out, seen = [], set(avoid)
        while len(out) < n:
            q, a = question(rng)
            if q in seen and len(q) > 3:  # sums of three or four numbers stay disjoint; the 100 pairs cannot
                continue
            seen.add(q)
            out.append((q, a))
        return out

    test = draw(n_test, set())
    val = draw(n_val, {q for q, _ in test})
    train_clean = draw(n_train, {q for q, _ in test + val})
    # a question is wrong everywhere it appears (two-number sums repeat): one stated answer per prompt
    stated: dict[str, int] = {}
    for q, a in train_clean:
        if q not in stated:
            stated[q] = wrong(a, rng) if rng.random() < noise else a
    train = [(q, stated[q], stated[q] != a) for q, a in train_clean]
    pretrain = draw(20_000, set())  # the base model's own curriculum, from the same distribution
    return Task(train, val, test, pretrain)


def write_rows(path: Path, rows) -> None:
    path.write_text("".join(json.dumps({"prompt": r[0], "answer": str(r[1])}) + "\n" for r in rows))


@functools.cache
def _tokenizer():
    from worker.model.loading import char_tokenizer

    return char_tokenizer()


def prompt(q: str, suffix: str = "") -> str:
    """A jsonl task's prompt (no instruction, no template); `suffix`: what an episode's first turn adds after
    the environment's observation (worker/environments/turns.py's PlainTurns: a newline)."""
    from worker.datasets import render_prompt

    return render_prompt(_tokenizer(), q, "") + suffix


def greedy_accuracy(model, tok, rows: list[tuple[str, int]], *, batch: int = 250, suffix: str = "") -> float:
    """Greedy answers of up to 4 tokens, decoded as the service's evaluation decodes them."""
    from scripts.eval_checkpoint import greedy
    from worker.rewards.functions import numeric_match

    answers = greedy(model, tok, [prompt(q, suffix) for q, _ in rows], max_new_tokens=4, batch=batch)
    return sum(numeric_match(c, [str(a)]) for c, (_, a) in zip(answers, rows)) / len(rows)


def pretrain_base(folder: Path, task: Task, *, target: float, seed: int, suffix: str = "") -> float:
    """A small Llama trained on clean sums until its greedy accuracy on the validation rows reaches `target`
    (prompts end with `suffix`; positions for a two-turn episode where they do)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.model.loading import char_tokenizer

    tok = char_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128 if suffix else 64, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rows, acc, step = task.pretrain, 0.0, 0
    while acc < target and step < 5000:
        model.train()
        batch = [rows[(step * 64 + i) % len(rows)] for i in range(64)]
        texts = [prompt(q, suffix) for q, _ in batch]
        full = [t + f" {a}" + tok.eos_token for t, (_, a) in zip(texts, batch)]
        enc = tok(full, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = enc["input_ids"].clone()
        for i, t in enumerate(texts):  # the loss on the answer only; left padding shifts each row's start
            pad = int((enc["attention_mask"][i] == 0).sum())
            labels[i, : pad + len(tok(t, add_special_tokens=False)["input_ids"])] = -100
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 50 == 0:
            model.eval()
            acc = greedy_accuracy(model, tok, task.val, suffix=suffix)
            print(f"  base model: step {step}, loss {loss.item():.3f}, validation accuracy {acc:.3f}", flush=True)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return acc


# -- the arms ----------------------------------------------------------------------------------------

def arm_spec(args: argparse.Namespace, arm: str, share: float | None) -> dict:
    tracin: dict = dict(ARMS[arm])
    if arm in INFLUENCE:
        tracin.update(val_prompts=args.val_prompts, val_generations=4, val_regenerate_every=1,
                      check_prediction=False)
    if arm in KEEPS_A_SHARE:
        tracin["fraction"] = round(min(1.0, max(share or 0.5, 0.01)), 3)
    return {**study_spec(args, "tracin", f"noisy-{arm}", samples_per_step=1), "tracin": tracin}


def study_spec(args: argparse.Namespace, kind: str, name: str, *, samples_per_step: int) -> dict:
    """A job on the study's model and files: LoRA r=16, 8 completions of 4 tokens at temperature 1, a checkpoint
    every --eval-every steps for the test curve, no evaluation inside the job."""
    return {
        "kind": kind, "name": name,
        # float32, as the studies' tables were measured: every arm in the precision of the others
        "model": {"name": args.model, "dtype": "float32", "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "dataset": {"name": "jsonl", "path": "train.jsonl", "val_path": "val.jsonl"},
        "rewards": [{"name": "numeric_match"}],
        "grpo": {"steps": args.steps, "prompts_per_step": args.prompts, "num_generations": 8, "max_new_tokens": 4,
                 "temperature": 1.0, "learning_rate": args.lr, "micro_batch_size": 64, "eval_every": 0,
                 "eval_prompts": 1, "checkpoint_every": args.eval_every, "samples_per_step": samples_per_step},
    }


@dataclass(frozen=True)
class Run:
    """One arm on one seed."""

    arm: str
    seed: int
    curve: dict[int, float]  # step -> test accuracy (step 0: the base model's)
    kept: float  # mean tracin/selection_ratio
    start_sha256: str  # the fingerprint's trainable_sha256: the weights training started from
    flags: tuple[int, int, int, int]  # rows with a gradient: (wrong and dropped, dropped, wrong, all of them)
    wall_s: float

    @property
    def auc(self) -> float:
        steps = sorted(self.curve)
        area = sum((b - a) * (self.curve[a] + self.curve[b]) / 2 for a, b in zip(steps, steps[1:]))
        return area / (steps[-1] - steps[0])


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def run_job(args: argparse.Namespace, spec: dict, name: str, seed: int) -> tuple[Path, float]:
    """`spec` with grpo.seed = seed, run by `grpo-jobs run` in its own process on the bench's model and data:
    its output folder and wall seconds."""
    spec = {**spec, "grpo": {**spec["grpo"], "seed": seed}}
    spec_file, out = args.work / f"{name}.yaml", args.work / name
    spec_file.write_text(yaml.safe_dump(spec))
    shutil.rmtree(out, ignore_errors=True)  # a run's records are its own, not appended to an earlier attempt's
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "GRPO_MODEL_ROOTS": str(args.work / "models"),
           "GRPO_DATASETS_ROOT": str(args.work / "data"), "GRPO_DATA_DIR": str(out / "service")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RUN, "run", str(spec_file), "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return out, time.perf_counter() - t0


def test_curve(args: argparse.Namespace, out: Path, task: Task, base_acc: float) -> dict[int, float]:
    """step -> greedy test accuracy of each checkpoint in `out` (step 0: the base model's)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    folder = args.work / "models" / args.model
    tok = AutoTokenizer.from_pretrained(folder)
    curve = {0: base_acc}
    for ckpt in sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1])):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), ckpt).eval()
        curve[int(ckpt.name.split("-")[1])] = greedy_accuracy(model, tok, task.test, suffix=args.prompt_suffix)
    return curve


def run_arm(args: argparse.Namespace, arm: str, seed: int, share: float | None, task: Task, base_acc: float) -> Run:
    spec = arm_spec(args, arm, share)
    out, wall = run_job(args, spec, f"{arm}-seed-{seed}", seed)
    [fp] = [e["data"] for e in lines(out / "events.jsonl") if e["type"] == "fingerprint"]
    curve = test_curve(args, out, task, base_acc)
    wrong_q = {prompt(q) for q, _, w in task.train if w}
    both = dropped = wrong_n = rows = 0
    for row in lines(out / "samples.jsonl"):
        if row.get("selected") is None or not row.get("advantage"):
            continue  # a row with no advantage carries no gradient: nothing to flag
        is_wrong, is_dropped = row["prompt"] in wrong_q, not row["selected"]
        both += is_wrong and is_dropped
        dropped += is_dropped
        wrong_n += is_wrong
        rows += 1
    ratios = [m["metrics"]["tracin/selection_ratio"] for m in lines(out / "metrics.jsonl")
              if "tracin/selection_ratio" in m["metrics"]]
    return Run(arm, seed, curve, statistics.fmean(ratios) if ratios else float("nan"), fp.get("trainable_sha256", ""),
               (both, dropped, wrong_n, rows), wall)


# -- the report --------------------------------------------------------------------------------------

def paired(runs: dict[str, dict[int, Run]], arm: str, seeds: list[int], value) -> evidence.Interval | None:
    return evidence.mean_interval([value(runs[arm][s]) - value(runs["all"][s]) for s in seeds])


def fmt(i: evidence.Interval | None) -> str:
    return "–" if i is None else f"{i.estimate:+.3f} [{i.low:+.3f}, {i.high:+.3f}]"


def report(runs: dict[str, dict[int, Run]], seeds: list[int], args: argparse.Namespace, base_acc: float) -> None:
    last = args.steps
    same = [s for s in seeds if len({runs[a][s].start_sha256 for a in runs}) == 1 and runs["all"][s].start_sha256]
    print(f"\n{len(seeds)} paired seeds, {last} steps, {args.prompts} prompts x 8 a step, {args.noise:.0%} wrong "
          f"training answers; base model's test accuracy {base_acc:.3f} on {args.test} held-out rows")
    print(f"starting weights identical across arms on {len(same)} of {len(seeds)} seeds (fingerprint trainable_sha256)")
    print(f"{'arm':<15}{'acc@' + str(last) + ' mean ± se':<18}{'vs all [95% CI]':<27}{'AUC mean ± se':<18}"
          f"{'vs all [95% CI]':<27}{'kept':<7}flags: precision / recall (base rate)")
    nan = float("nan")
    for arm in runs:
        acc = [runs[arm][s].curve[last] for s in seeds]
        auc = [runs[arm][s].auc for s in seeds]
        d = paired(runs, arm, seeds, lambda r: r.curve[last]) if arm != "all" else None
        da = paired(runs, arm, seeds, lambda r: r.auc) if arm != "all" else None
        flags = ""
        if arm in INFLUENCE:
            both, dropped, wrong_n, rows = (sum(runs[arm][s].flags[i] for s in seeds) for i in range(4))
            flags = (f"{both / dropped if dropped else nan:.3f} / {both / wrong_n if wrong_n else nan:.3f} "
                     f"({wrong_n / rows if rows else nan:.3f}: {wrong_n} wrong of {rows} rows with a gradient)")
        kept = statistics.fmean(runs[arm][s].kept for s in seeds)
        print(f"{arm:<15}{statistics.fmean(acc):.3f} ± {evidence.standard_error(acc):.3f}    {fmt(d):<27}"
              f"{statistics.fmean(auc):.3f} ± {evidence.standard_error(auc):.3f}    {fmt(da):<27}{kept:<7.2f}{flags}")
    for arm in runs:
        d = paired(runs, arm, seeds, lambda r: r.curve[last]) or evidence.Interval(nan, nan, nan)
        da = paired(runs, arm, seeds, lambda r: r.auc) or evidence.Interval(nan, nan, nan)
        print(f"RESULT arm={arm} seeds={len(seeds)} acc={statistics.fmean(runs[arm][s].curve[last] for s in seeds):.3f} "
              f"acc_se={evidence.standard_error([runs[arm][s].curve[last] for s in seeds]):.3f} diff={d.estimate:+.3f} "
              f"lo={d.low:+.3f} hi={d.high:+.3f} auc={statistics.fmean(runs[arm][s].auc for s in seeds):.3f} "
              f"auc_diff={da.estimate:+.3f} auc_lo={da.low:+.3f} auc_hi={da.high:+.3f}", flush=True)


def study_arguments(ap: argparse.ArgumentParser, *, noise: float, train: int, work: Path) -> None:
    """The seeds, the task, the runs and where they go: what this study and bench/selection.py ask alike."""
    ap.add_argument("--seeds", type=int, default=12, help="paired seeds")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=10, help="test accuracy every N steps (checkpoints)")
    ap.add_argument("--prompts", type=int, default=8, help="grpo.prompts_per_step (8 completions each)")
    ap.add_argument("--val-prompts", type=int, default=8, help="tracin.val_prompts (4 completions each)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=noise, help="share of training prompts with a wrong answer")
    ap.add_argument("--train", type=int, default=train, help="training rows")
    ap.add_argument("--val", type=int, default=200)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--base-acc", type=float, default=0.45, help="the base model's target validation accuracy")
    ap.add_argument("--parallel", type=int, default=2, help="runs at once")
    ap.add_argument("--threads", type=int, default=1, help="threads per run")
    ap.add_argument("--work", type=Path, default=work, help="data, base model and runs")
    ap.set_defaults(model=MODEL, prompt_suffix="")  # the base model's folder, and what its prompts end with


def prepare(args: argparse.Namespace) -> tuple[Task, float]:
    """The task's files and the base model in args.work (the model trained once, then reused), and the base
    model's test accuracy."""
    args.work = args.work.resolve()
    task = make_task(seed=0, n_train=args.train, n_val=args.val, n_test=args.test, noise=args.noise)
    (args.work / "data").mkdir(parents=True, exist_ok=True)
    write_rows(args.work / "data" / "train.jsonl", task.train)
    write_rows(args.work / "data" / "val.jsonl", task.val)
    write_rows(args.work / "data" / "test.jsonl", task.test)
    folder = args.work / "models" / args.model
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").exists():
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        pretrain_base(folder, task, target=args.base_acc, seed=0, suffix=args.prompt_suffix)
    base_acc = greedy_accuracy(AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder),
                               task.test, suffix=args.prompt_suffix)
    print(f"base model: test accuracy {base_acc:.3f}", flush=True)
    torch.set_num_threads(args.threads)
    return task, base_acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    study_arguments(ap, noise=0.3, train=2000, work=Path("/tmp/selection-noisy"))
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated; `all` is always run")
    args = ap.parse_args()
    task, base_acc = prepare(args)
    arms = [a for a in ARMS if a in set(args.arms.split(",")) | {"all"}]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    runs: dict[str, dict[int, Run]] = {a: {} for a in arms}

    def run(arm: str, seed: int, share: float | None) -> None:
        r = runs[arm][seed] = run_arm(args, arm, seed, share, task, base_acc)
        print(f"  {arm:<14} seed {seed}: test acc {r.curve[0]:.3f} -> {r.curve[args.steps]:.3f}, AUC {r.auc:.3f}, "
              f"kept {r.kept:.2f}, {r.wall_s:.0f} s", flush=True)

    with ThreadPoolExecutor(args.parallel) as pool:
        shares: dict[int, float | None] = {s: None for s in seeds}
        if "positive-adam" in arms:
            list(pool.map(lambda s: run("positive-adam", s, None), seeds))
            shares = {s: runs["positive-adam"][s].kept for s in seeds}
        rest = [(a, s) for a in arms if a != "positive-adam" for s in seeds]
        list(pool.map(lambda a_s: run(a_s[0], a_s[1], shares[a_s[1]]), rest))
    report(runs, seeds, args, base_acc)


if __name__ == "__main__":
    main()
