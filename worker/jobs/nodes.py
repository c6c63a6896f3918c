"""A job on several machines (`resources.nodes`), the worker's part.

The worker that leases the job is its node 0: it picks a port of GRPO_RENDEZVOUS_PORTS on its address
(GRPO_NODE_ADDRESS), joins the attempt as node 0 and sends one message per other node. A worker that takes
one joins the attempt as that node (service/store/nodes.py refuses a second delivery, an ended attempt and a
second node on the same machine). Every node then runs torch elastic's static rendezvous at node 0's address
(node ranks fixed, so global ranks go node by node and rank 0, on node 0, reports), waiting at most
GRPO_GANG_WAIT_S for the others. The attempt is one thing: a node whose ranks fail or whose worker dies
breaks the others' collectives, node 0's launch fails, and it fails the attempt over (queued again, it
resumes from its last checkpoint on whichever workers take it); a node 0 that dies leaves the others'
collectives broken too, and its lease expires as any job's does.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from service.core import queue
from service.core.settings import Settings
from service.core.specs import JobSpec
from service.store import nodes as nodes_q
from service.store import workers as workers_q
from service.store.db import session_scope
from service.store.leases import Lease
from worker.parallel.launch import Gang, GangIncomplete

log = logging.getLogger(__name__)


class NoRendezvousPort(Exception):
    """Every port of GRPO_RENDEZVOUS_PORTS is taken on this worker's machine."""


def rendezvous_endpoint(settings: Settings) -> str:
    """host:port where node 0 hosts an attempt's rendezvous: a free port of the range, tried from a random
    one so that two workers of one machine hosting at once rarely pick the same."""
    ports = list(settings.rendezvous_port_range)
    start = random.randrange(len(ports))
    for port in ports[start:] + ports[:start]:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's listener: closed ones' ports
            try:
                s.bind(("", port))  # the store listens on every interface
            except OSError:
                continue
        return f"{settings.rendezvous_address}:{port}"
    raise NoRendezvousPort(f"every port of GRPO_RENDEZVOUS_PORTS ({settings.rendezvous_ports}) is taken on node "
                           "0's machine")


def host(lease: Lease, *, settings: Settings, holder: str) -> Gang:
    """Node 0 of the leased attempt: the rendezvous it hosts, joined, and a message sent for each other node."""
    assert lease.spec is not None
    nodes, gpus = lease.spec.nodes, lease.spec.gpus
    endpoint = rendezvous_endpoint(settings)
    joined = nodes_q.join(settings.store_url, job_id=lease.job_id, uid=lease.uid, attempt=lease.attempt, head=holder,
                          node=0, node_name=settings.node, holder=holder)
    if isinstance(joined, str):  # the lease is ours: only a store that lost our row could say this
        raise RuntimeError(f"node 0 could not join its own attempt: {joined}")
    marker = shared_marker(settings, lease.uid, lease.attempt)  # each other node checks it sees node 0's files
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(holder)
    for node in range(1, nodes):
        queue.enqueue_node(queue.NodeMessage(job_id=lease.job_id, uid=lease.uid, gpus=gpus, attempt=lease.attempt,
                                             node=node, endpoint=endpoint, head=holder), broker_url=settings.broker)
    return Gang(nodes=nodes, node=0, endpoint=endpoint, wait_s=settings.gang_wait_s)


def too_few_machines(spec: JobSpec, *, settings: Settings) -> str | None:
    """Why the job's gang cannot form now (fewer live machines consume its queue than it has nodes), before
    this worker takes node 0 of it: then it waits queued, and this worker takes other work. None when it can."""
    with session_scope(settings.store_url, read_only=True) as session:
        live = workers_q.live_machines(session, queue=queue.queue_for(spec.gpus), within_s=settings.lease_timeout_s)
    if len(live) >= spec.nodes:
        return None
    return (f"waiting for {spec.nodes} workers on different machines (GRPO_NODE_NAME) to take a node each: "
            f"{len(live)} machine(s) have a live worker for it now. Queued again; single-node jobs run meanwhile")


def await_nodes(lease: Lease, *, settings: Settings, cancelled: Callable[[], bool]) -> bool:
    """Node 0's wait for the other nodes to be taken, read from the store every half second (so a cancel is
    heard at once, where the rendezvous itself blocks in C for its whole timeout): True once every node is,
    False when the job was cancelled meanwhile; GangIncomplete after GRPO_GANG_WAIT_S."""
    assert lease.spec is not None
    deadline = time.monotonic() + settings.gang_wait_s
    while (joined := nodes_q.joined_count(settings.store_url, job_id=lease.job_id,
                                          attempt=lease.attempt)) < lease.spec.nodes:
        if cancelled():
            return False
        if time.monotonic() >= deadline:
            raise GangIncomplete(f"{joined} of {lease.spec.nodes} nodes were taken within GRPO_GANG_WAIT_S "
                                 f"({settings.gang_wait_s:g} s)")
        time.sleep(0.5)
    return True


def shared_marker(settings: Settings, uid: str, attempt: int) -> Path:
    """A file node 0 writes for an attempt: rank 0 hands every rank the paths of checkpoints and data files in
    its cache, so every node must see the same GRPO_CACHE_DIR (a shared data dir)."""
    return settings.cache_dir / "nodes" / f"{uid}-{attempt}"


def sees_node_0(settings: Settings, message: queue.NodeMessage) -> bool:
    marker = shared_marker(settings, message.uid, message.attempt)
    try:
        return marker.read_text() == message.head
    except OSError:
        return False


class Watch:
    """A thread beside one node's launch that asks `lost()` every GRPO_HEARTBEAT_S whether the attempt is lost
    (on node 0: another node went silent; on the others: node 0's lease no longer holds the job). When it is,
    it stops this node's ranks: SIGTERM to this process, which the launcher turns into stopping them and raising
    LauncherStopped; `why` then says what happened. A rank stuck in a collective with a node that hangs (or a
    machine gone without closing its connections) would otherwise wait for the collective's timeout."""

    def __init__(self, lost: Callable[[], str | None], every_s: float) -> None:
        self.lost, self.every_s, self.why = lost, every_s, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="node-watch", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._done.wait(self.every_s):
            try:
                why = self.lost()
            except Exception as exc:  # the store is away: the lease's own rules decide, as for any job
                log.warning("node watch: %s: %s", type(exc).__name__, exc)
                continue
            if why is not None and not self._done.is_set():
                self.why = why
                log.warning("stopping this node's ranks: %s", why)
                os.kill(os.getpid(), signal.SIGTERM)
                return


def watch_others(lease: Lease, *, settings: Settings) -> Watch:
    """Node 0's watch: a node that has not beaten for GRPO_LEASE_TIMEOUT_S fails the attempt over."""
    def lost() -> str | None:
        silent = nodes_q.silent_nodes(settings.store_url, job_id=lease.job_id, attempt=lease.attempt,
                                      within_s=settings.lease_timeout_s)
        return (f"node {silent[0]} stopped answering (no heartbeat for {settings.lease_timeout_s:g} s, "
                "GRPO_LEASE_TIMEOUT_S)") if silent else None

    return Watch(lost, settings.heartbeat_s)


def watch_node_0(message: queue.NodeMessage, *, settings: Settings) -> Watch:
    """Another node's watch: it beats, and stops its ranks once the attempt is over on node 0's side."""
    def lost() -> str | None:
        live = nodes_q.beat(settings.store_url, job_id=message.job_id, attempt=message.attempt, node=message.node,
                            head=message.head)
        return None if live else f"attempt {message.attempt} is over on node 0"

    return Watch(lost, settings.heartbeat_s)


@dataclass(frozen=True)
class Waiting:
    """How a multi-node attempt that never started goes back to the queue: uncounted, with this event data,
    and sent again after a random pause, so that two multi-node jobs that each hold some of the workers do not
    meet again in the same order."""

    data: dict
    pause_s: float


def waiting(spec: JobSpec, *, settings: Settings) -> Waiting:
    return Waiting(data={"nodes": spec.nodes}, pause_s=random.uniform(0, min(settings.gang_wait_s, 30.0)))


def run_id(uid: str, attempt: int) -> str:
    """The rendezvous run id every node of an attempt (and every single-node attempt) launches with."""
    return f"job-{uid}-{attempt}"
