"""Fault injection on the production layout: `grpo-jobs serve` and `grpo-jobs worker` processes on
PostgreSQL and a Redis each test starts itself, with a TCP proxy in front of PostgreSQL that a
test can cut. Leases, heartbeats and sweeps are shortened through the settings so a fault is
noticed within seconds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from service.store import keys as keys_q
from service.store.db import session_scope
from service.store.migrate import upgrade
from tests.conftest import require
from tests.e2e.conftest import BIN, free_port, wait_http

LEASE_S = 6
FAULT_ENV = {"GRPO_LEASE_TIMEOUT_S": str(LEASE_S), "GRPO_HEARTBEAT_S": "1", "GRPO_SWEEP_S": "1",
             "GRPO_REQUEUE_QUEUED_AFTER_S": "15", "PYTHONUNBUFFERED": "1"}
# Long enough to be killed mid-way, short enough to keep the suite fast (a step takes ~0.1 s).
LONG_JOB = {"kind": "grpo", "name": "faults",
            "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
            "dataset": {"name": "arith", "num_train": 200, "num_val": 4},
            "grpo": {"steps": 40, "prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 8,
                     "eval_prompts": 2, "eval_every": 0, "checkpoint_every": 2, "samples_per_step": 2}}


class RedisServer:
    """A redis-server of the test's own on a free port, to kill and start again."""

    def __init__(self, log_dir: Path) -> None:
        self.port, self.log_dir, self.proc = free_port(), log_dir, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.log_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class TcpProxy:
    """Forwards a local port to PostgreSQL; `cut()` drops every connection and refuses new ones
    until `restore()`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.port = target, free_port()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server: socket.socket | None = None

    def start(self) -> None:
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._open = True
        threading.Thread(target=self._accept, args=(self._server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if not self._open:  # cut while this one was being set up
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        with self._lock:
            self._open = False
            conns, self._conns = self._conns, []
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it
        except OSError:
            pass
        self._server.close()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def restore(self) -> None:
        for _ in range(50):  # the port may linger for a moment after close
            try:
                self.start()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"could not listen on {self.port} again")


class Cluster:
    """API and worker processes of one deployment, talked to over HTTP."""

    def __init__(self, tmp_path: Path, env: dict) -> None:
        self.tmp_path, self.env = tmp_path, env
        self.procs: dict[str, subprocess.Popen] = {}
        self.base: str | None = None
        self.key: str | None = None

    def start(self, name: str, *args: str, **env: str) -> subprocess.Popen:
        log = (self.tmp_path / f"{name}.log").open("a")
        # its own session: kill -9 of the group takes the worker's pool children with it
        p = subprocess.Popen([str(BIN), *args], env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs[name] = p
        return p

    def serve(self, *, ready: bool = True, port: int | None = None, **env: str) -> None:
        """Start `serve` (on `port`, else a free one); with `ready`, wait until its background migration
        check is done (/readyz)."""
        port = port or free_port()
        self.start("api", "serve", "--port", str(port), **env)
        self.base = f"http://127.0.0.1:{port}"
        wait_http(f"{self.base}/{'readyz' if ready else 'healthz'}", self)

    def worker(self, name: str = "worker", **env: str) -> subprocess.Popen:
        return self.start(name, "worker", "--loglevel", "INFO", **env)

    def kill_group(self, name: str) -> None:
        p = self.procs.pop(name)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def client(self, timeout: float = 30) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {self.key}"}, timeout=timeout)

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-4000:]}" for f in sorted(self.tmp_path.glob("*.log")))

    def stop(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def redis_server(tmp_path):
    require("redis-server", "127.0.0.1", 6379)  # the same package provides the binary
    r = RedisServer(tmp_path)
    r.start()
    yield r
    if r.proc.poll() is None:
        r.kill()


@pytest.fixture
def cluster(tmp_path, models_root, pg_url, redis_server):
    """serve + workers on a fresh PostgreSQL database and a Redis of the test's own."""
    env = {**os.environ, **FAULT_ENV, "GRPO_DATA_DIR": str(tmp_path / "data"), "GRPO_MODELS_ROOT": str(models_root),
           "DATABASE_URL": pg_url, "BROKER_URL": redis_server.url}
    upgrade(pg_url)
    owner = f"faults-{uuid.uuid4().hex[:6]}"
    c = Cluster(tmp_path, {**env, "GRPO_ADMIN_OWNERS": owner})  # the operator: it sees which worker runs what
    with session_scope(pg_url) as s:
        c.key = keys_q.create_key(s, owner=owner)
    yield c
    c.stop()


def wait_for(predicate, what: str, cluster: Cluster, timeout: float = 120, every: float = 0.3):
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{cluster.logs()}")


def job_state(c: httpx.Client, job_id: int) -> dict:
    return c.get(f"/v1/jobs/{job_id}").json()


def finished(c: httpx.Client, job_id: int, cluster: Cluster, timeout: float = 180) -> dict:
    return wait_for(lambda: (j := job_state(c, job_id))["status"] in ("succeeded", "failed", "cancelled") and j,
                    f"job {job_id} to finish", cluster, timeout=timeout, every=0.5)


def reached_step(c: httpx.Client, job_id: int, step: int, cluster: Cluster) -> dict:
    return wait_for(lambda: (j := job_state(c, job_id))["step"] >= step and j,
                    f"job {job_id} to reach step {step}", cluster, timeout=180, every=0.2)


def assert_every_step_once(c: httpx.Client, job_id: int, steps: int) -> None:
    """Every step's metrics were recorded exactly once, and the job ended at its last step."""
    series = c.get(f"/v1/jobs/{job_id}/metrics", params={"keys": "reward/mean,loss/total"}).json()["series"]
    for s in series:
        assert [p["step"] for p in s["points"]] == list(range(1, steps + 1)), s["key"]
    samples = c.get(f"/v1/jobs/{job_id}/samples", params={"limit": 1000}).json()
    per_step: dict[int, set[int]] = {}
    for row in samples:
        assert row["index"] not in per_step.setdefault(row["step"], set()), f"step {row['step']} sampled twice"
        per_step[row["step"]].add(row["index"])
