"""API load on PostgreSQL: concurrent clients against the metrics and job-list routes of a real
`grpo-jobs serve`, then the job list again while 100 live streams are open; each phase with the API on 1
process and on --api-workers processes (`serve --workers N`), side by side in one run.

Works in a scratch database beside --url: one job with 30 steps x 23 metric keys (the size of a
real GRPO run's chart page), 50 more jobs for the list. Each phase runs --clients concurrent
clients (asyncio + httpx, one process) for --seconds and prints requests/s and p50/p95/p99. The metrics
route is polled twice: full bodies, and conditionally (each client sends the ETag it got, and the
unchanged run answers 304 with no body), as the dashboard and `grpo-jobs watch` poll.

    python bench/api_load.py [--url postgresql+psycopg://postgres@127.0.0.1:5432/test] [--clients 20]

Ends with: RESULT metrics_rps_wN=... metrics_p95_ms_wN=... metrics_304_rps_wN=... metrics_304_p95_ms_wN=...
list_rps_wN=... list_p95_ms_wN=... list_p95_ms_with_streams_wN=... for N in 1 and --api-workers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load(name: str, base: str, key: str, path: str, params: dict, *, clients: int, seconds: float,
               conditional: bool = False) -> Phase:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
            headers = {"If-None-Match": (await c.get(path, params=params)).headers["etag"]} if conditional else {}
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                r = await c.get(path, params=params, headers=headers)
                assert r.status_code == (304 if conditional else 200), r.status_code
                latencies.append((time.perf_counter() - t) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return Phase(name, len(latencies), time.perf_counter() - t0, latencies)


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


def seed(url: str) -> tuple[str, int, list[int]]:
    upgrade(url)
    with session_scope(url) as s:
        key = keys_q.create_key(s, owner="bench")
        jobs = [jobs_q.create_job(s, owner="bench", kind="grpo", spec={}, name=f"job-{i}", total_steps=30)[0]
                for i in range(51)]
        s.flush()
        ids = [j.id for j in jobs]
        metrics_q.upsert_points(s, rows=[(ids[0], k, step, step * 0.01 + i) for i, k in enumerate(METRIC_KEYS)
                                         for step in range(1, 31)])
    return key, ids[0], ids


async def run(args, base: str, port: int, key: str, job_id: int, ids: list[int]) -> list[Phase]:
    phases = []
    # warm up: the first requests open the pool's connections
    await load("warm-up", base, key, "/v1/jobs", {}, clients=args.clients, seconds=1)
    phases.append(await load("GET /v1/jobs/{id}/metrics", base, key, f"/v1/jobs/{job_id}/metrics", {},
                             clients=args.clients, seconds=args.seconds))
    phases.append(await load("  the same, If-None-Match", base, key, f"/v1/jobs/{job_id}/metrics", {},
                             clients=args.clients, seconds=args.seconds, conditional=True))
    phases.append(await load("GET /v1/jobs", base, key, "/v1/jobs", {}, clients=args.clients, seconds=args.seconds))
    writers = await open_streams(port, key, ids, args.streams)
    await asyncio.sleep(2)
    phases.append(await load(f"GET /v1/jobs, {args.streams} streams", base, key, "/v1/jobs", {},
                             clients=args.clients, seconds=args.seconds))
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
    ap.add_argument("--api-workers", type=int, default=os.cpu_count() or 1,
                    help="API processes of the second run of every phase (the first has 1)")
    args = ap.parse_args()

    with scratch_database(args.url) as url:
        measure(args, url)


def measure(args, url: str) -> None:
    key, job_id, ids = seed(url)
    get_engine(url).dispose()
    results = []
    for workers in sorted({1, args.api_workers}):
        phases = serve_and_load(args, url, key, job_id, ids, workers)
        print(f"-- serve --workers {workers}")
        for p in phases:
            print(p.line())
        metrics, conditional, listing, with_streams = phases
        results.append(f"metrics_rps_w{workers}={metrics.rps:.0f} metrics_p95_ms_w{workers}={metrics.pct(95):.1f} "
                       f"metrics_304_rps_w{workers}={conditional.rps:.0f} "
                       f"metrics_304_p95_ms_w{workers}={conditional.pct(95):.1f} "
                       f"list_rps_w{workers}={listing.rps:.0f} list_p95_ms_w{workers}={listing.pct(95):.1f} "
                       f"list_p95_ms_with_streams_w{workers}={with_streams.pct(95):.1f}")
    print("RESULT " + " ".join(results))


def serve_and_load(args, url: str, key: str, job_id: int, ids: list[int], workers: int) -> list[Phase]:
    api = None
    try:
        port = free_port()
        env = {**os.environ, "DATABASE_URL": url, "GRPO_DATA_DIR": tempfile.mkdtemp(prefix="grpo-bench-")}
        bin_ = Path(sys.executable).parent / "grpo-jobs"
        api = subprocess.Popen([str(bin_), "serve", "--port", str(port), "--workers", str(workers)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{base}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return asyncio.run(run(args, base, port, key, job_id, ids))
    finally:
        if api is not None:
            api.terminate()
            api.wait(timeout=30)


if __name__ == "__main__":
    main()
