"""The nodes of a multi-node job (`resources.nodes`). The worker that leases the job is node 0: it hosts the
attempt's rendezvous and sends a message for each other node; a worker that takes one joins the attempt
here. A node joins once (a redelivered message is dropped), only the attempt that sent it (a message of an
attempt that ended is dropped), and never on a worker that says it is the same machine as another node of
the attempt. Node 0 holds the job's lease and records everything; the others record nothing but their join."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.core.specs import JobSpec, Status, parse_stored_spec
from service.store.db import session_scope
from service.store.models import Job, JobEvent, JobNode, utcnow


@dataclass(frozen=True)
class Joined:
    """What a node's worker needs of the job it joined."""

    job_id: int
    uid: str
    owner: str
    spec: JobSpec
    attempt: int


Refused = Literal["ended", "taken", "same machine"]  # the attempt is over; the node has its worker; see above


def forget_attempt(session: Session, *, job_id: int, attempt: int) -> None:
    """The nodes of an attempt given back before it started: the next lease takes the same attempt number."""
    session.execute(delete(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == attempt))


def join(url: str, *, job_id: int, uid: str, attempt: int, head: str, node: int, node_name: str,
         holder: str) -> Joined | Refused:
    """Node `node` of the job's attempt `attempt`, led by node 0 `head` (the lease's holder), runs on `holder`
    (on machine `node_name`), with an event saying so; or why not."""
    try:
        with session_scope(url) as session:
            # FOR UPDATE: a give-back (leases.requeue) moving the lease at this moment either waits for this join
            # and then forgets its node, or commits first and this reads the job queued. Without the lock both
            # commit and a node of a gang that never ran stays, stale, in the next lease's attempt of that number
            job = session.scalars(select(Job).where(Job.id == job_id, Job.uid == uid, Job.attempt == attempt,
                                                    Job.lease_owner == head, Job.status == Status.running)
                                  .with_for_update()).first()
            if job is None:
                return "ended"
            spec = parse_stored_spec(job.spec)
            session.add(JobNode(job_id=job_id, attempt=attempt, node=node, node_name=node_name, holder=holder))
            session.flush()  # the constraints decide here, before the event
            session.add(JobEvent(job_id=job_id, type="node", message=f"node {node} of {spec.nodes} "
                                 f"(attempt {attempt}) taken by a worker",
                                 data={"node": node, "attempt": attempt, "node_name": node_name, "holder": holder}))
            return Joined(job_id=job_id, uid=job.uid, owner=job.owner, spec=spec, attempt=attempt)
    except IntegrityError:
        with session_scope(url, read_only=True) as session:
            taken = session.get(JobNode, (job_id, attempt, node)) is not None
        return "taken" if taken else "same machine"


def nodes_of(session: Session, *, job_id: int) -> list[JobNode]:
    """The nodes of the job's latest attempt that has any, by node."""
    latest = select(func.max(JobNode.attempt)).where(JobNode.job_id == job_id).scalar_subquery()
    return list(session.scalars(select(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == latest)
                                .order_by(JobNode.node)))


def node_failed(url: str, *, job_id: int, attempt: int, node: int, message: str) -> None:
    """Node `node`'s ranks failed with `message` (node 0, whose collectives break with them, fails the attempt)."""
    with session_scope(url) as session:
        session.add(JobEvent(job_id=job_id, type="node_failed", level="warning",
                             message=f"node {node} (attempt {attempt}): {message}",
                             data={"node": node, "attempt": attempt}))


def beat(url: str, *, job_id: int, attempt: int, node: int, head: str) -> bool:
    """Node `node` of the attempt is alive (its heartbeat renewed). False once the attempt is over: node 0's
    lease no longer holds the job (it failed over, ended, or node 0 stopped heartbeating and the sweep took it)."""
    with session_scope(url) as session:
        session.execute(update(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == attempt,
                                              JobNode.node == node).values(heartbeat_at=utcnow())
                        .execution_options(synchronize_session=False))
        live = session.scalar(select(Job.id).where(Job.id == job_id, Job.attempt == attempt, Job.lease_owner == head,
                                                   Job.status == Status.running))
    return live is not None


def silent_nodes(url: str, *, job_id: int, attempt: int, within_s: float) -> list[int]:
    """The nodes of the attempt (other than 0, which holds the lease) not heard from within `within_s`."""
    cutoff = utcnow() - timedelta(seconds=within_s)
    with session_scope(url, read_only=True) as session:
        return list(session.scalars(select(JobNode.node).where(
            JobNode.job_id == job_id, JobNode.attempt == attempt, JobNode.node > 0, JobNode.heartbeat_at < cutoff)
            .order_by(JobNode.node)))


def joined_count(url: str, *, job_id: int, attempt: int) -> int:
    """How many nodes of the attempt have been taken by a worker (node 0 among them)."""
    with session_scope(url, read_only=True) as session:
        return session.scalar(select(func.count()).select_from(JobNode).where(JobNode.job_id == job_id,
                                                                               JobNode.attempt == attempt))
