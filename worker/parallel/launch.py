"""Running a function as N processes (ranks) of one job on this machine, through torch.distributed's
elastic launch API (what `torchrun` runs): one rank per GPU with NCCL where there are enough
GPUs, gloo ranks sharing the CPU cores otherwise.

The launcher's agent runs in the calling process and watches the ranks: when one fails (an
exception, or killed by a signal) it stops the others, so no rank is left waiting in a
collective, and `launch` raises `RanksFailed` naming the rank and what happened to it. Each
rank also dies with the process that launched it (PR_SET_PDEATHSIG), so a killed worker leaves
no orphan ranks behind.

Ranks are forked from a fork server (multiprocessing's `forkserver`) that has imported torch,
transformers, peft and the loops once: a rank starts in a fraction of a second instead of paying
those imports (about 6 s of CPU) itself. Where the launching process has imported them already and
has no other thread yet (a worker's pool process as a job starts, `grpo-jobs run`), the server is forked
from it; otherwise it is a fresh interpreter that imports them. Either way no thread, lock or device of
the launching process's running job reaches a rank. The server lives as long as the launching process;
its children die with it, so the chain above still holds. The rank runs with the launching process's
environment as it is at launch, not as it was when the server started.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import AuthenticationString
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from service.core.specs.runtime import gpus_named
from worker.parallel.distributed import Ranks

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a collective waits this long for a slow rank (evaluation, a checkpoint)
# What a rank raises when a peer went away: a consequence, never the cause, of a failed attempt.
_PEER_GONE = ("DistBackendError", "DistNetworkError", "DistStoreError", "RuntimeError: [")
PEER_GONE_GRACE_S = 3.0


@dataclass  # not frozen: raising sets __traceback__, which a context manager's exit assigns again
class RanksFailed(Exception):
    """A rank failed. `killed`: by a signal (out of memory, killed by hand), not by an error of its own."""

    rank: int
    message: str
    killed: bool
    peer_gone: bool = False  # every failed rank here failed because a peer went away: the cause is on another node

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.message}"


class LauncherStopped(Exception):
    """The launching process was told to stop (SIGTERM, SIGINT): the ranks were stopped with it."""


@dataclass(frozen=True)
class Gang:
    """This process's node of a job that spans several machines: where all its nodes meet."""

    nodes: int
    node: int  # 0 hosts the rendezvous; ranks are numbered node by node
    endpoint: str  # host:port of node 0's rendezvous store
    wait_s: float  # how long a node waits for the others to arrive


class GangIncomplete(Exception):
    """The other nodes of a multi-node job did not all arrive at the rendezvous in time (or node 0's could not
    be reached or hosted)."""


def launch(entry: Callable[..., Any], args: tuple, *, processes: int, run_id: str | None = None,
           gang: Gang | None = None) -> dict[int, Any]:
    """`entry(*args, ranks=Ranks(...))` in `processes` ranks (on this node of `gang`, if the job spans several);
    each rank's return value by rank."""
    if gang is None:  # one node: a rendezvous of its own, on any free port
        nodes = dict(min_nodes=1, max_nodes=1, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0")
    else:  # the static rendezvous: node ranks fixed by the service (node 0 leased the job, and reports)
        nodes = dict(min_nodes=gang.nodes, max_nodes=gang.nodes, rdzv_backend="static", rdzv_endpoint=gang.endpoint,
                     rdzv_configs={"rank": gang.node, "timeout": max(1, round(gang.wait_s))})
    config = LaunchConfig(**nodes, nproc_per_node=processes, run_id=run_id or uuid.uuid4().hex, max_restarts=0,
                          monitor_interval=0.5, start_method=START_METHOD, shutdown_timeout=10)
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    handlers = {s: signal.getsignal(s) for s in stop_signals}
    in_main = threading.current_thread() is threading.main_thread()  # where the agent installs its own
    if in_main:  # until the agent installs its handlers (once the rendezvous is done), a stop is ours to raise
        for s in stop_signals:
            signal.signal(s, _stop)
    # A Celery pool process is daemonic, and multiprocessing refuses children to daemons (so that
    # none outlives it); the ranks instead die with it (PR_SET_PDEATHSIG), so let it start them.
    # Its authkey is billiard's, which refuses to be pickled for a spawned child: hand it on as
    # multiprocessing's own.
    me = multiprocessing.current_process()
    saved = dict(me._config)
    me._config.update(daemon=False, authkey=AuthenticationString(bytes(me.authkey)))
    try:
        try:
            base = _fork_server() if START_METHOD == "forkserver" else dict(os.environ)
            return elastic_launch(config, _rank_main)(entry, args, base, dict(os.environ))
        except ChildFailedError as exc:
            raise _cause(exc) from None
        except (dist.DistError, TimeoutError) as exc:  # only the rendezvous raises these here: ranks' are above
            if gang is None:
                raise
            raise GangIncomplete(f"node {gang.node} of {gang.nodes} at {gang.endpoint}: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    except SignalException as exc:  # the agent stopped the ranks before re-raising; or none had started
        # (a signal that arrived while the rendezvous blocked is raised once it returns, maybe in a handler above)
        raise LauncherStopped(f"the worker was told to stop ({exc.sigval.name})") from None
    finally:
        me._config.update(saved)
        if in_main:
            for s, h in handlers.items():
                signal.signal(s, h)


def _stop(signum: int, frame: object) -> None:
    """A stop signal before the agent's own handler is in place (during the rendezvous): raised as the agent's
    handler would, so that the caller's handler (a Celery pool process exits on it) never sees it."""
    raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.Signals(signum))


START_METHOD = "forkserver"  # "spawn": each rank imports everything itself (bench/rank_start.py compares)
_server_env: dict[int, dict[str, str]] = {}  # the environment each fork server (by pid) started with
_rank_preload: list[str] = []
# a server forked from a Celery pool process would keep its handlers (the pool's own SIGTERM, a stop request's
# SIGUSR2 ignored): ranks start with the defaults, as a fresh server's do
_SERVER_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def visible_gpus() -> int:
    """The GPUs this process sees (CUDA_VISIBLE_DEVICES applied)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(world: int, local: int, gpus: int) -> tuple[str, str]:
    """(backend, device) of local rank `local` of `world` on a machine with `gpus` GPUs: NCCL on a GPU of
    its own where there is one for every rank, else gloo on the CPU. NCCL refuses two ranks on one GPU
    ("Duplicate GPU detected"), so fewer GPUs than ranks never reach it."""
    return ("nccl", f"cuda:{local}") if gpus >= world else ("gloo", "cpu")


def trainer_gpus(device: str, world: int) -> set[int]:
    """The GPUs a job's processes train on, from a rank's device: the one it names for a single process,
    the first `world` for several (rank_device gives local rank i cuda:i), none on the CPU."""
    d = torch.device(device)
    if d.type != "cuda":
        return set()
    return {d.index or 0} if world == 1 else set(range(world))


def place(asked: str, gpus: int) -> str:
    """The device a one-process job trains on, from its `devices.policy` on a worker that sees `gpus` GPUs:
    'auto' is the first GPU where there is one, else the CPU; a GPU named that the worker does not have is
    refused with the field (torch would say only that CUDA is unavailable, or an invalid ordinal)."""
    if asked == "auto":
        return "cuda:0" if gpus else "cpu"
    if gpus_named(asked) > gpus:
        seen = f"{gpus} GPU(s)" if gpus else "no GPU"
        raise ValueError(f"devices.policy {asked!r}: this worker sees {seen}; use 'auto' to train where the "
                         "worker can")
    return asked


def placement_warning(processes: int, gpus: int) -> str | None:
    """What a user is told when `processes` ranks will train on the CPU of a machine that has GPUs."""
    if gpus and rank_device(processes, 0, gpus)[1] == "cpu":  # rank_device's rule, not a second copy of it
        return (f"{processes} processes on a worker with {gpus} GPU(s): the ranks train on the CPU over gloo, "
                f"since NCCL needs a GPU of its own for each rank; set resources.processes to at most {gpus} "
                "to train on the GPUs")
    return None


def preload_in_ranks(modules: list[str]) -> None:
    """Modules the fork server imports once, before it forks any rank (the runner names the loops, and
    with them torch, transformers and peft). Named before a process's first launch."""
    _rank_preload.extend(m for m in modules if m not in _rank_preload)


def _fork_server() -> dict[str, str]:
    """Starts this process's fork server if it is not running (again, if it died): forked from this process
    where it can be (`fork_server_here`), else a fresh interpreter that imports the loops. The environment
    it started with, which every rank forked from it inherits."""
    server = multiprocessing.forkserver._forkserver
    if not fork_server_here():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_rank_preload)
        server.ensure_running()
    return _server_env.setdefault(server._forkserver_pid, dict(os.environ))


def fork_server_here() -> bool:
    """Fork this process's fork server from this process, as it is now, if it has none running: its ranks then
    inherit the loops this process has imported, instead of a fresh server importing them again (about 5 s of
    CPU a job). Only while nothing can reach the server that a fork would break: this process has no other
    thread (a lock another thread held would stay held in every rank) and has not initialised CUDA. Whether
    this process's server is running now."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:
        try:
            if os.waitpid(server._forkserver_pid, os.WNOHANG)[0] == 0:
                return True  # still running
        except ChildProcessError:  # a parent's server, its state inherited by a fork: this process needs its own
            pass
        os.close(server._forkserver_alive_fd)  # gone (or not ours): started again below, as ensure_running would
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    if threading.active_count() > 1 or torch.cuda.is_initialized():
        return False
    multiprocessing.resource_tracker.ensure_running()  # before the fork, as ensure_running starts it
    address = multiprocessing.connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    if not multiprocessing.util.is_abstract_socket_namespace(address):  # as ensure_running: a path has a mode
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server: multiprocessing's own loop, in this process's image
        code = 1
        try:
            os.close(alive_w)
            for s in _SERVER_DEFAULT_SIGNALS:  # what the launching process installed is not the ranks'
                signal.signal(s, signal.SIG_DFL)
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # not a Celery pool's logging proxies
            multiprocessing.forkserver.main(listener.fileno(), alive_r, [])
            code = 0
        finally:
            os._exit(code)
    listener.close()
    os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    _server_env[pid] = dict(os.environ)
    return True


def _take_env(base: dict[str, str], launcher: dict[str, str]) -> None:
    """The launcher's environment in a rank forked from a server that started with `base`; what the
    elastic agent set for this rank (RANK, MASTER_PORT...) differs from `base` and is kept."""
    for key in base.keys() | launcher.keys():
        if os.environ.get(key) != base.get(key):
            continue
        if key in launcher:
            os.environ[key] = launcher[key]
        else:
            os.environ.pop(key, None)


def _cause(exc: ChildFailedError) -> RanksFailed:
    """The failure that caused the others: a killed rank, else an error that is not a peer gone."""
    failures = sorted(exc.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    for rank, f in failures:
        if f.exitcode < 0:
            return RanksFailed(rank, f"killed by {f.signal_name()}", killed=True)
    for rank, f in failures:
        if not _text(f.message).startswith(_PEER_GONE):
            return RanksFailed(rank, _text(f.message), killed=False)
    rank, f = failures[0]
    return RanksFailed(rank, _text(f.message), killed=False, peer_gone=True)


def _text(message: str | dict) -> str:
    """The `Type: message` line of a rank's error file (nested when the entry point is wrapped twice)."""
    while isinstance(message, dict):
        message = message.get("message", "")
    return str(message)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent (the fork server) dies, and the fork server
    ends when the launching process does: multiprocessing keeps a server up while the launcher or any
    child of the server holds its liveness pipe, so this rank lets its copy go."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call above
            os._exit(1)
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def agreed_backend(choices: list[str]) -> str:
    """The backend every rank of a job on several machines uses: NCCL only where every rank could (NCCL and gloo
    ranks in one group never meet), so a machine without a GPU for each of its ranks puts them all on gloo."""
    return "nccl" if all(c == "nccl" for c in choices) else "gloo"


def _agreed(backend: str, device: str, *, rank: int, world: int) -> tuple[str, str]:
    """(backend, device) of this rank once every rank has said what its machine allows, through the
    rendezvous store the ranks are about to form their group on (MASTER_ADDR:MASTER_PORT)."""
    store = dist.PrefixStore(f"grpo-backend/{os.environ.get('TORCHELASTIC_RUN_ID', '')}",
                             dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                           timeout=COLLECTIVE_TIMEOUT))
    store.set(str(rank), backend)
    keys = [str(r) for r in range(world)]
    store.wait(keys)
    agreed = agreed_backend([store.get(k).decode() for k in keys])
    return (backend, device) if agreed == backend else (agreed, "cpu")


@record  # an exception's message reaches the launcher in the rank's error file
def _rank_main(entry: Callable[..., Any], args: tuple, base_env: dict[str, str], launcher_env: dict[str, str]) -> Any:
    _die_with_parent()
    _take_env(base_env, launcher_env)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    here = int(os.environ["LOCAL_WORLD_SIZE"])  # this node's ranks: they share its GPUs, or its cores
    backend, device = rank_device(here, local, visible_gpus())
    if world > here:  # several machines: one backend for all of them
        backend, device = _agreed(backend, device, rank=rank, world=world)
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // here))  # ranks share the cores
    else:
        torch.cuda.set_device(local)
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    # On an error the group is left to the process's exit: closing it first would let the other
    # ranks fail on the closed connection before this rank's error file says what happened.
    try:
        out = entry(*args, ranks=Ranks(rank, world, device, here))
    except Exception as exc:
        if f"{type(exc).__name__}: {exc}".startswith(_PEER_GONE):
            # a consequence: let the rank that caused it exit first, so the launcher sees its error too
            # (on a loaded machine this rank could otherwise be the only failure it has seen)
            time.sleep(PEER_GONE_GRACE_S)
        raise
    dist.destroy_process_group()
    return out
