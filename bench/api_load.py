"""API load on PostgreSQL: concurrent clients against the metrics and job-list routes of a real
`grpo-jobs serve`, then the job list again while 100 live streams are open; each phase with the API on 1
process and on --api-workers processes (`serve --workers N`), side by side in one run.

Works in a scratch database beside --url: one job with 30 steps x 23 metric keys (the size of a real GRPO
run's chart page), a live job that gains a step (23 keys) every second while the phases run, a long run of
10,000 steps x 50 keys, and 50 more jobs for the list. Each phase runs its clients (asyncio + httpx, one
process) for --seconds and prints requests/s and p50/p95/p99:

- the metrics of the 30-step job: full bodies (--clients), then conditionally (each client sends the ETag it
  got and the unchanged run answers 304 with no body) with --clients and with --pollers clients;
- the live job polled incrementally by --pollers clients, as the dashboard polls a chart it has: each sends
  its last ETag and `after_step` its last step, and gets a 304 or only the new points;
- the long run's chart page (its default 1,000 points a series, min/max buckets) and its body's size;
- the job list, then the list with --streams live streams open.

The load generator runs pinned to the last core and the server to the others where the machine has more
than two (`taskset`-style affinity; --no-pin: all share every core); the header line says how it ran.

    python bench/api_load.py [--url postgresql+psycopg://postgres@127.0.0.1:5432/test] [--clients 20]

Ends with: RESULT metrics_rps_wN=... metrics_p95_ms_wN=... metrics_304_rps_wN=... metrics_304_p95_ms_wN=...
metrics_304_rps_100_wN=... metrics_304_p95_ms_100_wN=... incremental_rps_wN=... incremental_p95_ms_wN=...
long_run_rps_wN=... long_run_p95_ms_wN=... list_rps_wN=... list_p95_ms_wN=... list_p95_ms_with_streams_wN=...
for N in 1 and --api-workers, and long_run_body_kb.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from scratch_db import (  # bench/ is on the path when a bench runs
    DEFAULT_URL,
    scratch_database,
)

from service.store import jobs as jobs_q
from service.store import keys as keys_q
from service.store import metrics as metrics_q
from service.store.db import get_engine, session_scope
from service.store.migrate import upgrade

METRIC_KEYS = [
    "reward/mean", "reward/std", "reward/numeric_match/mean", "frac_reward_zero_std", "advantage/abs_mean",
    "loss/policy", "loss/total", "kl", "ratio/mean", "ratio/max", "clip_ratio/region_mean", "entropy",
    "completions/mean_length", "completions/clipped_ratio", "grad_norm", "lr", "time/rollout_s", "time/train_s",
    "time/step_s", "throughput/tokens_per_s", "eval/reward_mean", "eval/accuracy", "rollout/refill_rounds",
]


@dataclass
class Phase:
    name: str
    requests: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def pct(self, q: int) -> float:
        return statistics.quantiles(self.latencies_ms, n=100)[q - 1]

    def line(self) -> str:
        return (f"{self.name:28s} {self.rps:7.1f} req/s   p50 {self.pct(50):6.1f} ms   p95 {self.pct(95):6.1f} ms"
                f"   p99 {self.pct(99):6.1f} ms   ({self.requests} requests)")


def shown(phase: Phase) -> Phase:
    """The phase, printed as soon as it ends."""
    print(phase.line(), flush=True)
    return phase


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load(name: str, base: str, key: str, path: str, params: dict, *, clients: int, seconds: float,
               conditional: bool = False) -> Phase:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
            headers = {}
            if conditional:
                first = await c.get(path, params=params)
                assert first.status_code == 200, (first.status_code, first.text[:300])
                headers = {"If-None-Match": first.headers["etag"]}
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                r = await c.get(path, params=params, headers=headers)
                assert r.status_code == (304 if conditional else 200), r.status_code
                latencies.append((time.perf_counter() - t) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return shown(Phase(name, len(latencies), time.perf_counter() - t0, latencies))


async def poll_incrementally(name: str, base: str, key: str, path: str, *, clients: int, seconds: float) -> Phase:
    """Clients that each keep their last ETag and step and ask only for what is newer, as a chart does."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
            first = await c.get(path)
            etag, last = first.headers["etag"], max(p["step"] for s in first.json()["series"] for p in s["points"])
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                r = await c.get(path, params={"after_step": last}, headers={"If-None-Match": etag})
                latencies.append((time.perf_counter() - t) * 1000)
                assert r.status_code in (200, 304), r.status_code
                if r.status_code == 200:
                    etag = r.headers["etag"]
                    last = max([last] + [p["step"] for s in r.json()["series"] for p in s["points"]])

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return shown(Phase(name, len(latencies), time.perf_counter() - t0, latencies))


class LiveRun:
    """A job that gains a step of METRIC_KEYS every second, written by a thread of the load generator."""

    def __init__(self, url: str, job_id: int) -> None:
        self.url, self.job_id, self.step = url, job_id, 30
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._write, daemon=True)

    def _write(self) -> None:
        while not self.stop.wait(1.0):
            self.step += 1
            with session_scope(self.url) as s:
                metrics_q.upsert_step(s, job_id=self.job_id, step=self.step,
                                      values={k: self.step * 0.01 + i for i, k in enumerate(METRIC_KEYS)})

    def __enter__(self) -> LiveRun:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


async def open_streams(port: int, key: str, job_ids: list[int], n: int) -> list[asyncio.StreamWriter]:
    writers = []
    for i in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET /v1/jobs/{job_ids[i % len(job_ids)]}/stream HTTP/1.1\r\nHost: x\r\n"
                     f"Authorization: Bearer {key}\r\nAccept: text/event-stream\r\n\r\n".encode())
        await writer.drain()
        head = await reader.readuntil(b"event: status")
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        writers.append(writer)
    return writers


LONG_STEPS, LONG_KEYS = 10_000, 50


@dataclass(frozen=True)
class Seeded:
    key: str
    job_id: int  # 30 steps x 23 keys
    live_id: int  # 30 steps, one more every second while the phases run
    long_id: int  # LONG_STEPS x LONG_KEYS
    ids: list[int]  # every job, for the list and the streams


def seed(url: str) -> Seeded:
    upgrade(url)
    with session_scope(url) as s:
        key = keys_q.create_key(s, owner="bench")
        jobs = [jobs_q.create_job(s, owner="bench", kind="grpo", spec={}, name=f"job-{i}", total_steps=30)[0]
                for i in range(53)]
        s.flush()
        ids = [j.id for j in jobs]
        for job in ids[:2]:
            metrics_q.upsert_points(s, rows=[(job, k, step, step * 0.01 + i) for i, k in enumerate(METRIC_KEYS)
                                             for step in range(1, 31)])
    rng = random.Random(0)
    for lo in range(1, LONG_STEPS + 1, 1000):  # a long run's points, a thousand steps a transaction
        with session_scope(url) as s:
            metrics_q.upsert_points(s, rows=[(ids[2], f"long/{k}", step, rng.gauss(k, 1.0)) for k in range(LONG_KEYS)
                                             for step in range(lo, lo + 1000)])
    return Seeded(key=key, job_id=ids[0], live_id=ids[1], long_id=ids[2], ids=ids)


async def run(args, base: str, port: int, seeded: Seeded) -> dict[str, Phase]:
    key, job_id, ids, n = seeded.key, seeded.job_id, seeded.ids, args.seconds
    phases = {}
    # warm up: the first requests open the pool's connections
    await load("warm-up", base, key, "/v1/jobs", {}, clients=args.clients, seconds=1)
    metrics = f"/v1/jobs/{job_id}/metrics"
    phases["metrics"] = await load("GET /v1/jobs/{id}/metrics", base, key, metrics, {}, clients=args.clients, seconds=n)
    phases["metrics_304"] = await load("  the same, If-None-Match", base, key, metrics, {}, clients=args.clients,
                                       seconds=n, conditional=True)
    phases["metrics_304_100"] = await load(f"  the same, {args.pollers} clients", base, key, metrics, {},
                                           clients=args.pollers, seconds=n, conditional=True)
    phases["incremental"] = await poll_incrementally(f"live run, {args.pollers} after_step", base, key,
                                                     f"/v1/jobs/{seeded.live_id}/metrics", clients=args.pollers, seconds=n)
    phases["long_run"] = await load(f"{LONG_STEPS:,} steps x {LONG_KEYS} keys", base, key,
                                    f"/v1/jobs/{seeded.long_id}/metrics", {}, clients=4, seconds=n)
    phases["list"] = await load("GET /v1/jobs", base, key, "/v1/jobs", {}, clients=args.clients, seconds=n)
    writers = await open_streams(port, key, ids, args.streams)
    await asyncio.sleep(2)
    phases["list_with_streams"] = await load(f"GET /v1/jobs, {args.streams} streams", base, key, "/v1/jobs", {},
                                             clients=args.clients, seconds=n)
    for w in writers:
        w.close()
    return phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=DEFAULT_URL,
                    help="an existing database; the benchmark works in a scratch database beside it")
    ap.add_argument("--clients", type=int, default=20, help="concurrent clients")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--streams", type=int, default=100, help="live streams open during the last phase")
    ap.add_argument("--pollers", type=int, default=100, help="clients of the 100-poller phases")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="let the load generator share every core with the server")
    ap.add_argument("--api-workers", type=int, default=os.cpu_count() or 1,
                    help="API processes of the second run of every phase (the first has 1)")
    args = ap.parse_args()

    with scratch_database(args.url) as url:
        measure(args, url)


def placement(pin: bool) -> tuple[set[int] | None, set[int]]:
    """(the server's cores, the load generator's): the generator alone on the last core where at least two
    are left to the server; None for the server when nothing is pinned."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 3:
        return None, set(cores)
    return set(cores[:-1]), {cores[-1]}


def measure(args, url: str) -> None:
    seeded = seed(url)
    get_engine(url).dispose()
    server_cores, load_cores = placement(args.pin)
    os.sched_setaffinity(0, load_cores)
    print(f"load generator on cores {sorted(load_cores)}, server on "
          f"{'the same cores' if server_cores is None else sorted(server_cores)}")
    results = []
    for workers in sorted({1, args.api_workers}):
        print(f"-- serve --workers {workers}", flush=True)
        with LiveRun(url, seeded.live_id):
            phases = serve_and_load(args, url, seeded, workers, server_cores)
        results.append(" ".join(f"{name}_rps_w{workers}={p.rps:.0f} {name}_p95_ms_w{workers}={p.pct(95):.1f}"
                                for name, p in phases.items()))
    with httpx.Client(headers={"Authorization": f"Bearer {seeded.key}"}) as c, \
            serving(url, seeded.key, 1, server_cores) as (base, _):
        body = c.get(f"{base}/v1/jobs/{seeded.long_id}/metrics").content
    print(f"long run's chart page: {len(body) / 1024:.0f} KB for {LONG_STEPS:,} steps x {LONG_KEYS} keys")
    print("RESULT " + " ".join(results) + f" long_run_body_kb={len(body) / 1024:.0f}")


@contextmanager
def serving(url: str, key: str, workers: int, cores: set[int] | None) -> Iterator[tuple[str, int]]:
    """`grpo-jobs serve --workers N` on a free port (on `cores`), answering: its base URL and port."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": url, "GRPO_DATA_DIR": tempfile.mkdtemp(prefix="grpo-bench-")}
    bin_ = Path(sys.executable).parent / "grpo-jobs"
    cmd = [str(bin_), "serve", "--port", str(port), "--workers", str(workers)]
    if cores is not None:
        cmd = ["taskset", "-c", ",".join(map(str, sorted(cores)))] + cmd
    api = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{base}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield base, port
    finally:
        api.terminate()
        api.wait(timeout=30)


def serve_and_load(args, url: str, seeded: Seeded, workers: int, cores: set[int] | None) -> dict[str, Phase]:
    with serving(url, seeded.key, workers, cores) as (base, port):
        return asyncio.run(run(args, base, port, seeded))


if __name__ == "__main__":
    main()
