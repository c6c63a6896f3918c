"""The registry of running workers: each worker's main process says what it has (its GPUs, the queues it
consumes) every sweep; the API lists the live ones and tells a job that needs GPUs no live worker has why
it waits. A worker that stops saying so (killed, cut off from the store) is gone after the lease timeout."""

from __future__ import annotations

from dataclasses import asdict
from datetime import timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from service.core.queue import queue_for
from service.core.records import WorkerInfo
from service.store.db import session_scope
from service.store.models import Worker, utcnow

FORGET_AFTER = timedelta(days=1)  # a row this stale is deleted by the next worker that says it is alive


def beat(url: str, *, info: WorkerInfo) -> None:
    """`info`'s worker is alive now: its row renewed, or written for the first time (also after the store
    lost it: a restore, a worker thought gone)."""
    now = utcnow()
    with session_scope(url) as session:
        renewed = session.execute(update(Worker).where(Worker.name == info.name).values(seen_at=now)
                                  .execution_options(synchronize_session=False)).rowcount
        if not renewed:
            session.add(Worker(name=info.name, hostname=info.hostname, gpus=[asdict(g) for g in info.gpus],
                               queues=info.queues, concurrency=info.concurrency, started_at=now, seen_at=now))
        session.execute(delete(Worker).where(Worker.seen_at < now - FORGET_AFTER))


def leave(url: str, *, name: str) -> None:
    """A worker that stops cleanly is gone at once."""
    with session_scope(url) as session:
        session.execute(delete(Worker).where(Worker.name == name))


def live_workers(session: Session, *, within_s: float) -> list[Worker]:
    """Workers seen within `within_s` seconds, the oldest first."""
    since = utcnow() - timedelta(seconds=within_s)
    return list(session.scalars(select(Worker).where(Worker.seen_at >= since).order_by(Worker.id)))


def why_waiting(session: Session, *, gpus: int, within_s: float) -> str | None:
    """Why a job that needs `gpus` GPUs on one worker will wait: no live worker has them (None when one has)."""
    live = live_workers(session, within_s=within_s)
    if any(len(w.gpus) >= gpus for w in live):
        return None
    seen = (f"the {len(live)} live worker(s) have {', '.join(sorted({str(len(w.gpus)) for w in live}))} GPU(s)"
            if live else "no worker is live")
    return (f"this job needs {gpus} GPU(s) on one worker (its devices name a GPU) and {seen}: it waits in queue "
            f"{queue_for(gpus)!r} until a worker with {gpus} starts; or set devices.policy 'auto' to run anywhere")


def live_machines(session: Session, *, queue: str, within_s: float) -> set[str]:
    """The machines (node names) with a live worker consuming `queue`: how many nodes of a job could start now."""
    return {w.hostname for w in live_workers(session, within_s=within_s) if queue in w.queues}
