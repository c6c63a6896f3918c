"""Runs a vLLM server as its child and ends the server's whole process group when the job's process
is gone, however it went (a SIGKILLed worker included): vLLM's engine-core processes outlive their
API server when it is killed, so the group, not one process, is what must end.

It runs under the engine's own Python (`GRPO_VLLM_PYTHON`), so it imports nothing of this package:

    python vllm_watchdog.py JOB_PID -- ARGS...   (ARGS: the server's command line)

Started in a new session by worker/engines/vllm_engine.py, so the group holds exactly the watchdog, the
server and the server's children.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0


def _end_group(grace_s: float = GRACE_S) -> None:
    """SIGTERM to the whole group (this process ignores it), then, once the others have exited or `grace_s`
    has passed, SIGKILL to whatever is left, this process included."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _others_running():
        time.sleep(0.05)
    os.killpg(0, signal.SIGKILL)


def _others_running() -> bool:
    """Whether a process of this group other than this one still runs (a zombie has ended). Without /proc,
    assumed so: the whole grace is waited."""
    if not os.path.isdir("/proc"):
        return True
    me, group = os.getpid(), os.getpgid(0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(pgrp) == group and state != "Z":
            return True
    return False


def main() -> None:
    job_pid, args = int(sys.argv[1]), sys.argv[sys.argv.index("--") + 1:]
    try:  # Linux: be told at once when the job's process dies; polling below covers the rest
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    signal.signal(signal.SIGTERM, lambda *_: _end_group())
    server = subprocess.Popen(args)
    while server.poll() is None:
        if os.getppid() != job_pid:
            _end_group()
        time.sleep(POLL_S)
    print(f"vllm_watchdog: the server exited with {server.returncode}", file=sys.stderr, flush=True)
    _end_group(grace_s=2.0)  # the server's engine processes may still be running


if __name__ == "__main__":
    main()
