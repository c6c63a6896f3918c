"""Where a job's ranks are forked from (worker/parallel/launch.py): a fork server forked from the launching
process while it has no other thread, so the ranks inherit its imports; a fresh server otherwise. Each case
runs in a Python of its own: a pytest-xdist process has threads of its own."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[3]


def rank_facts(*, ranks) -> dict:
    """What a rank sees: its parent, whether it inherited torch, the environment at launch."""
    return {"rank": ranks.rank, "parent": os.getppid(), "torch": "torch" in sys.modules,
            "after": os.environ.get("SET_AFTER_THE_SERVER")}


def _run(body: str) -> str:
    script = textwrap.dedent("""
        import os, threading
        import worker.parallel.launch as launch
        from tests.worker.parallel.test_launch import rank_facts
        server = lambda: launch.multiprocessing.forkserver._forkserver._forkserver_pid
        cmdline = lambda pid: open(f"/proc/{pid}/cmdline", "rb").read()
    """) + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_a_single_threaded_launcher_forks_its_server_and_the_ranks_inherit_its_imports():
    out = _run("""
        assert launch.fork_server_here() and launch.fork_server_here()  # forked once, then found running
        pid = server()
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # this process's child
        assert cmdline(pid) == cmdline(os.getpid())  # this process's image, not a fresh interpreter
        os.environ["SET_AFTER_THE_SERVER"] = "yes"
        facts = launch.launch(rank_facts, (), processes=2)
        assert server() == pid and sorted(facts) == [0, 1], facts
        assert all(f["parent"] == pid and f["torch"] and f["after"] == "yes" for f in facts.values()), facts
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_launcher_with_another_thread_starts_a_fresh_server():
    out = _run("""
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        assert not launch.fork_server_here()
        facts = launch.launch(rank_facts, (), processes=2)
        assert b"from multiprocessing.forkserver import main" in cmdline(server())
        assert all(f["parent"] == server() and f["rank"] in (0, 1) for f in facts.values()), facts
        stop.set()
        print("ok")
    """)
    assert out.strip() == "ok"
