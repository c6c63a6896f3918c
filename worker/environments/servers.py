"""A bundled environment's server, started by the job's process on loopback and ended with it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from worker.engines.vllm_engine import free_port
from worker.environments.client import EnvironmentFailed

START_TIMEOUT_S = 120.0
_OPEN: list[BundledServer] = []  # servers this process started; stop_servers() ends the calling thread's


class BundledServer:
    """`python -m worker.environments.serve NAME` on 127.0.0.1, ending when this process does."""

    def __init__(self, name: str, log_path: Path, *, max_sessions: int = 256, ping_interval_s: float = 20.0,
                 python: Path | None = None, step_delay_s: float = 0.0) -> None:
        """`python`: the interpreter of an environment with another OpenEnv release (this one's by default);
        `step_delay_s`: each step first waits a random 0 to this many seconds."""
        self.name, self.log_path, self.python = name, log_path, python
        self.options = ["--max-sessions", str(max_sessions), "--ping-interval", str(ping_interval_s),
                        "--step-delay", str(step_delay_s)]
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.owner = threading.get_ident()  # the thread whose job (or test) it serves

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        """Start it and wait until it answers /health; its base URL."""
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **self._path()})
        _OPEN.append(self)
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise EnvironmentFailed(f"the {self.name} environment server exited with {self.proc.returncode} "
                                            f"while starting: {self.log_tail()}")
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return self.url
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise EnvironmentFailed(f"the {self.name} environment server was not ready within {START_TIMEOUT_S:.0f} s")

    def argv(self) -> list[str]:
        """The server's command line, on `self.port` (a server of another module overrides it)."""
        return [str(self.python or sys.executable), "-m", "worker.environments.serve", self.name, "--port",
                str(self.port), "--parent", str(os.getpid()), *self.options]

    def _path(self) -> dict[str, str]:
        """Another environment's interpreter finds the worker's modules through PYTHONPATH."""
        if self.python is None:
            return {}
        root = str(Path(__file__).resolve().parents[2])
        return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}

    def log_tail(self, lines: int = 10) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(line.strip()[:300] for line in text[-lines:] if line.strip())

    def sessions(self) -> dict[str, int]:
        """Its sessions, as the server counts them: `open` now, and the `most` open at once."""
        return httpx.get(f"{self.url}/sessions", timeout=5.0).json()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self in _OPEN:
            _OPEN.remove(self)


def stop_servers() -> None:
    """Stop every environment server the calling thread started (its job's loop has ended, or failed): a job
    running in another thread of this process keeps its own."""
    me = threading.get_ident()
    for server in [s for s in _OPEN if s.owner == me]:
        server.stop()
