"""Serve a bundled environment as an OpenEnv server (openenv-core's own app: `/ws`, `/reset`, `/step`,
`/health`, `/schema`), and `/sessions` (its sessions open now and the most at once):

    python -m worker.environments.serve calculator --port 8011 [--host 127.0.0.1] [--max-sessions N] [--parent PID]

A worker starts one per job on loopback with `--parent`: the server ends when that process does,
however it ends. Anyone may run one by hand to try an environment, or for TRL's environment_factory.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time


def _die_with(parent: int) -> None:
    """End this server when `parent` is gone (SIGKILLed included)."""
    try:  # Linux: told at once
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def slowed(env: type, most_s: float) -> type:
    """`env` whose every step first sleeps a random 0 to `most_s` seconds (in its session's own thread)."""
    import random

    class Slowed(env):  # type: ignore[valid-type, misc]
        def step(self, action, timeout_s=None, **kwargs):
            time.sleep(random.uniform(0.0, most_s))
            return super().step(action, timeout_s=timeout_s, **kwargs)

    return Slowed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=("calculator", "multiplication", "guess-number"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-sessions", type=int, default=256, help="WebSocket sessions open at once")
    p.add_argument("--ping-interval", type=float, default=20.0,
                   help="seconds between the server's WebSocket pings (a client that does not answer one within "
                   "as long is closed)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="each step first waits a random 0 to this many seconds (a slow environment, for benchmarks)")
    p.add_argument("--parent", type=int, default=None, help="end when this process id is gone")
    args = p.parse_args(argv)
    if args.parent is not None:
        _die_with(args.parent)
    # openenv-core builds a web UI when gradio imports; a bundled server has no use for it, and gradio's
    # import alone takes ~10 s of the server's start
    sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    from worker.environments.bundled import ENVIRONMENTS, SESSIONS, TextAction, TextObservation

    env = ENVIRONMENTS[args.name]
    if args.step_delay > 0:
        env = slowed(env, args.step_delay)
    app = create_app(env, TextAction, TextObservation, env_name=args.name, max_concurrent_envs=args.max_sessions)
    app.add_api_route("/sessions", lambda: {"open": SESSIONS.open, "most": SESSIONS.most}, methods=["GET"])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", ws_max_size=1 << 20,
                ws_ping_interval=args.ping_interval, ws_ping_timeout=args.ping_interval)


if __name__ == "__main__":
    main()
