"""Peak memory, step time and tokens/s of the demo spec at longer generation budgets, for this
checkout's code and another's (today's path and the new one), side by side in one run.

    python bench/memory.py --baseline ../base-checkout            # every case, both codes
    python bench/memory.py --baseline ../base --cases 24,256      # some cases
    git worktree add /tmp/base <commit>                            # a baseline checkout

Each case is a separate `grpo-jobs run` process of the demo spec (SmolLM2-135M, LoRA r=16, 4 prompts
x 8 completions, micro_batch_size 16) for `--steps` steps, evaluation on one prompt. Cases:
`24`, `256`, `1024`: grpo.max_new_tokens; `1024p`: 256 new tokens after a prompt of about 1,024
tokens (a long system prompt). Peak RSS is read from /proc every 50 ms over the whole process; a
process above `--limit-gb` is stopped and reported as over it. Step time is the median over steps
after the first (which warms up), tokens/s the completion tokens of those steps over their time.
On a GPU (`--set devices.policy=cuda`) the most any step allocated there (`memory/cuda_peak_gb`)
is printed too, for the code that reports it. `--set KEY=VALUE` changes the spec for both codes.
A benchmark, never a test. Ends with one RESULT line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "demo-smollm2.yaml"
RUN = "import sys; from service.cli import main; sys.argv[0] = 'grpo-jobs'; main()"
# About 1,024 SmolLM2 tokens of system prompt: a long instruction, as a retrieval or agent prompt would be.
LONG_PROMPT = ("You are a careful assistant. Read the question, think about the quantities it names, and "
               "answer with the final number. ") * 40


@dataclass(frozen=True)
class Case:
    name: str
    max_new_tokens: int
    long_prompt: bool = False


CASES = {c.name: c for c in (Case("24", 24), Case("256", 256), Case("1024", 1024), Case("1024p", 256, True))}


@dataclass(frozen=True)
class Measured:
    peak_gb: float
    over_limit: bool
    step_s: float  # median over steps after the first; nan when it did not finish
    tokens_per_s: float
    cuda_peak_gb: float | None = None  # the most any step had allocated on the GPU (memory/cuda_peak_gb)


def _rss_gb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 2**20
    except (FileNotFoundError, StopIteration, ProcessLookupError):
        return 0.0


def spec_for(case: Case, steps: int, overrides: tuple[str, ...] = ()) -> dict:
    d = yaml.safe_load(SPEC.read_text())
    for item in overrides:  # "grpo.micro_batch_size=8": a dotted path, a YAML value
        path, _, value = item.partition("=")
        *parents, leaf = path.split(".")
        node = d
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    g = d["grpo"]
    g.update(steps=steps, max_new_tokens=case.max_new_tokens, eval_every=0, eval_prompts=1, samples_per_step=0,
             checkpoint_every=0)
    if case.long_prompt:
        d["dataset"]["system_prompt"] = LONG_PROMPT
    return d


def run_case(case: Case, code: Path, *, steps: int, limit_gb: float, work: Path,
             overrides: tuple[str, ...] = ()) -> Measured:
    tag = f"{case.name}-{abs(hash(str(code)))}"
    spec_file, out = work / f"{tag}.yaml", work / tag
    spec_file.write_text(yaml.safe_dump(spec_for(case, steps, overrides)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", RUN, "run", str(spec_file), "--out", str(out)], env=env,
                            cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak, over = 0.0, False
    while proc.poll() is None:
        peak = max(peak, _rss_gb(proc.pid))
        if peak > limit_gb:
            over = True
            proc.kill()
            break
        time.sleep(0.05)
    err = proc.communicate()[1]
    if proc.returncode != 0 and not over:
        raise SystemExit(f"case {case.name} ({code}) failed ({proc.returncode}):\n{err[-3000:]}")
    nan = float("nan")
    if over:
        return Measured(peak, True, nan, nan)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_m = [m["metrics"] for m in lines if m["step"] > 1 and "time/step_s" in m["metrics"]]
    step_s = statistics.median(m["time/step_s"] for m in steps_m)
    tps = sum(m["throughput/tokens_per_s"] * m["time/step_s"] for m in steps_m) / sum(m["time/step_s"] for m in steps_m)
    cuda = [m["metrics"]["memory/cuda_peak_gb"] for m in lines if "memory/cuda_peak_gb" in m["metrics"]]
    return Measured(peak, False, step_s, tps, max(cuda) if cuda else None)


def _fmt(m: Measured, limit_gb: float) -> str:
    peak = f">{limit_gb:.0f}" if m.over_limit else f"{m.peak_gb:.2f}"
    cuda = "" if m.cuda_peak_gb is None else f" ({m.cuda_peak_gb:.2f} GB CUDA)"
    return f"{peak:>7} GB{cuda} {m.step_s:7.1f} s {m.tokens_per_s:7.1f} tok/s"


def _cuda(new: Measured, base: Measured | None) -> str:
    out = "" if new.cuda_peak_gb is None else f" cuda_peak_gb={new.cuda_peak_gb:.2f}"
    if base is not None and base.cuda_peak_gb is not None:
        out += f" base_cuda_peak_gb={base.cuda_peak_gb:.2f}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="another checkout (today's path); omitted: this checkout only")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first is not timed)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="change the spec for both codes, e.g. --set model.gradient_checkpointing=true")
    ap.add_argument("--limit-gb", type=float, default=20.0, help="stop a run whose RSS passes this")
    args = ap.parse_args()
    codes = {"new": ROOT} | ({"base": args.baseline.resolve()} if args.baseline else {})
    print(f"{'case':<6} " + "  ".join(f"{k + ' (' + str(v.name) + ')':<34}" for k, v in codes.items()))
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            case = CASES[name]
            got = {k: run_case(case, code, steps=args.steps, limit_gb=args.limit_gb, work=Path(tmp),
                               overrides=tuple(args.overrides))
                   for k, code in reversed(codes.items())}
            print(f"{name:<6} " + "  ".join(f"{_fmt(got[k], args.limit_gb):<34}" for k in codes), flush=True)
            new, base = got["new"], got.get("base")
            ratios = ""
            if base is not None:
                ratios = (f" base_peak_gb={base.peak_gb:.2f} base_over_limit={base.over_limit} "
                          f"peak_ratio={new.peak_gb / base.peak_gb:.3f} step_time_ratio={new.step_s / base.step_s:.3f}")
            print(f"RESULT case={name} max_new_tokens={case.max_new_tokens} long_prompt={case.long_prompt} "
                  f"peak_gb={new.peak_gb:.2f} over_limit={new.over_limit} step_s={new.step_s:.2f} "
                  f"tokens_per_s={new.tokens_per_s:.1f}{_cuda(new, base)}{ratios}", flush=True)


if __name__ == "__main__":
    main()
