"""What the tinker-compatible API costs per operation: a forward_backward + optim_step round trip through
the real SDK, against the same computation in-process (the session loop's own functions, same model,
same bodies), on the embedded default (`grpo-jobs dev`: SQLite store and broker) and on PostgreSQL +
Redis (`grpo-jobs serve` + `grpo-jobs worker`, a scratch database and a redis-server of its own).

Then, on each served layout, what batching the sample requests buys: --samples single-completion
requests sent together (as an RL loop sends a step's), against the same sent one at a time.

    python bench/primitives.py [--model tiny-random-llama|smollm2-135m-instruct] [--rounds 20]
                               [--batch 4] [--tokens 64] [--samples 16] [--sample-tokens 16]
                               [--url postgresql+psycopg://postgres@127.0.0.1:5432/test]

Prints p50/p95 per layout and the overhead (p50 over in-process), and the sampling times. Ends with:
RESULT inprocess_p50_ms=... embedded_p50_ms=... embedded_p95_ms=... postgres_p50_ms=... postgres_p95_ms=...
       embedded_overhead_ms=... postgres_overhead_ms=... embedded_samples_together_s=...
       embedded_samples_one_by_one_s=... postgres_samples_together_s=... postgres_samples_one_by_one_s=...
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from scratch_db import DEFAULT_URL, scratch_database  # bench/ is on the path when a bench runs

BIN = Path(sys.executable).parent / "grpo-jobs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data(args, vocab: int):
    from tinker import types

    rng = np.random.default_rng(0)
    out = []
    for _ in range(args.batch):
        tokens = rng.integers(1, vocab, size=args.tokens + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * args.tokens}))
    return out


def percentiles(ms: list[float]) -> tuple[float, float]:
    return statistics.median(ms), statistics.quantiles(ms, n=20)[18]


def timed(fn: Callable[[], None], rounds: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def in_process(args) -> list[float]:
    """The session loop's forward_backward and optim_step on the same bodies, with no service between."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from service.core.settings import Settings
    from service.core.specs import LoraSpec, ModelSpec, SessionJob, SessionSpec
    from worker.reporting import FileReporter
    from worker.session.run import forward_backward, load, optim_step

    out = Path(tempfile.mkdtemp(prefix="bench-primitives-"))
    spec = SessionJob(model=ModelSpec(name=args.model, dtype="float32", lora=LoraSpec(r=args.rank, alpha=args.rank)),
                      session=SessionSpec(tinker_session="bench", model_id="0" * 32, seed=0))
    s = load(spec, Settings(), FileReporter(out))
    batch = data(args, s.vocab_size)
    body = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=batch, loss_fn="cross_entropy"),
        model_id="m", seq_id=1)).SerializeToString()
    step = b'{"adam_params": {"learning_rate": 1e-4}}'
    reporter = FileReporter(out)

    def once() -> None:
        forward_backward(s, body)
        optim_step(s, step, reporter)

    try:
        return timed(once, args.rounds)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@dataclass(frozen=True)
class Measured:
    round_trips_ms: list[float]  # forward_backward + optim_step, each
    samples_together_s: float  # args.samples requests sent at once, until the last answer
    samples_one_by_one_s: float  # the same, each sent once the one before was answered


def through_sdk(base: str, key: str, args) -> Measured:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base, api_key=key)
    client = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=0).result()
    vocab = {"tiny-random-llama": 100}.get(args.model, 49152)
    batch = data(args, vocab)

    def once() -> None:
        fb = client.forward_backward(batch, "cross_entropy")
        step = client.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        step.result()

    round_trips = timed(once, args.rounds)
    # args.samples single-completion requests, as an RL loop sends them: all at once, then one at a time
    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=args.sample_tokens, temperature=1.0, stop=[])
    prompts = [types.ModelInput.from_ints(row.model_input.to_ints()[:16]) for row in batch]
    sampler.sample(prompts[0], 1, params).result()  # warm
    t0 = time.perf_counter()
    for f in [sampler.sample(prompts[i % len(prompts)], 1, params) for i in range(args.samples)]:
        f.result()
    together = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(args.samples):
        sampler.sample(prompts[i % len(prompts)], 1, params).result()
    return Measured(round_trips, together, time.perf_counter() - t0)


def wait_up(url: str, procs: list[subprocess.Popen], timeout: float = 90) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a service process exited; see its log")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} never came up")


@contextmanager
def started(*commands: list[str], env: dict, log_dir: Path) -> Iterator[list[subprocess.Popen]]:
    procs = [subprocess.Popen(c, env=env, stdout=(log_dir / f"{i}.log").open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for i, c in enumerate(commands)]
    try:
        yield procs
    finally:
        for p in procs:
            os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


def embedded(args, env: dict) -> Measured:
    tmp = Path(tempfile.mkdtemp(prefix="bench-primitives-dev-"))
    port = free_port()
    env = {**env, "GRPO_DATA_DIR": str(tmp)}
    env.pop("DATABASE_URL", None)
    env.pop("BROKER_URL", None)
    with started([str(BIN), "dev", "--port", str(port)], env=env, log_dir=tmp) as procs:
        wait_up(f"http://127.0.0.1:{port}/readyz", procs)
        key_file = tmp / "dev-api-key"
        while not key_file.exists():
            time.sleep(0.1)
        return through_sdk(f"http://127.0.0.1:{port}", key_file.read_text().strip(), args)


def postgres(args, env: dict) -> Measured:
    from service.store import keys as keys_q
    from service.store.db import session_scope
    from service.store.migrate import upgrade

    tmp = Path(tempfile.mkdtemp(prefix="bench-primitives-pg-"))
    redis_port, port = free_port(), free_port()
    with scratch_database(args.url) as url, started(
            ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"], env=env, log_dir=tmp):
        upgrade(url)
        with session_scope(url) as s:
            key = keys_q.create_key(s, owner="bench")
        env = {**env, "GRPO_DATA_DIR": str(tmp), "DATABASE_URL": url, "BROKER_URL": f"redis://127.0.0.1:{redis_port}/0"}
        with started([str(BIN), "serve", "--port", str(port)], [str(BIN), "worker"], env=env, log_dir=tmp) as procs:
            wait_up(f"http://127.0.0.1:{port}/readyz", procs)
            return through_sdk(f"http://127.0.0.1:{port}", key, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random-llama")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="sequences per forward_backward")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--url", default=DEFAULT_URL, help="PostgreSQL server for the scratch database")
    parser.add_argument("--samples", type=int, default=16, help="single-completion sample requests")
    parser.add_argument("--sample-tokens", type=int, default=16, help="tokens per completion")
    args = parser.parse_args()
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONUNBUFFERED": "1"}
    inprocess = in_process(args)
    served = {"embedded": embedded(args, env), "postgres": postgres(args, env)}
    print(f"{args.model}, LoRA r={args.rank}, {args.batch} x {args.tokens} tokens, cross_entropy; "
          f"{args.rounds} round trips of forward_backward + optim_step each")
    print(f"{'layout':<12} {'p50 ms':>8} {'p95 ms':>8} {'overhead p50 ms':>16}")
    base = percentiles(inprocess)[0]
    fields = {}
    for name, ms in [("inprocess", inprocess)] + [(n, m.round_trips_ms) for n, m in served.items()]:
        p50, p95 = percentiles(ms)
        print(f"{name:<12} {p50:8.1f} {p95:8.1f} {p50 - base:16.1f}")
        fields[f"{name}_p50_ms"], fields[f"{name}_p95_ms"] = p50, p95
        if name != "inprocess":
            fields[f"{name}_overhead_ms"] = p50 - base
    print(f"{args.samples} sample requests of {args.sample_tokens} tokens: sent together (sampled in one batch) "
          "against one at a time")
    print(f"{'layout':<12} {'together s':>11} {'one by one s':>13} {'ratio':>6}")
    for name, m in served.items():
        ratio = m.samples_one_by_one_s / m.samples_together_s
        print(f"{name:<12} {m.samples_together_s:11.2f} {m.samples_one_by_one_s:13.2f} {ratio:6.1f}")
        fields[f"{name}_samples_together_s"], fields[f"{name}_samples_one_by_one_s"] = (
            m.samples_together_s, m.samples_one_by_one_s)
    print("RESULT " + " ".join(f"{k}={v:.2f}" if k.endswith("_s") else f"{k}={v:.1f}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
