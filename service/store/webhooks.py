"""Webhooks and their deliveries (service/core/webhooks.py says what is sent and when).

A delivery is recorded by the flush that records the job event raising it (a job's outcome, a red
health flag), so a job never ends without its deliveries and never gets two for one event: every
path that ends a job (a worker, a cancel, the sweep) adds its event through a session, and
`_enqueue_deliveries` sees it there."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, event, func, select, update
from sqlalchemy.orm import Session

from service.core import webhooks as hooks
from service.store.models import Job, JobEvent, Webhook, WebhookDelivery, utcnow


def create_webhook(session: Session, *, owner: str, url: str, events: list[str]) -> Webhook:
    hook = Webhook(owner=owner, url=url, events=events, secret=hooks.new_secret())
    session.add(hook)
    session.flush()
    return hook


def count_webhooks(session: Session, *, owner: str) -> int:
    return session.scalar(select(func.count()).select_from(Webhook).where(Webhook.owner == owner)) or 0


def list_webhooks(session: Session, *, owner: str) -> list[Webhook]:
    return list(session.scalars(select(Webhook).where(Webhook.owner == owner).order_by(Webhook.id)))


def get_webhook(session: Session, *, owner: str, webhook_id: int) -> Webhook | None:
    return session.scalars(select(Webhook).where(Webhook.id == webhook_id, Webhook.owner == owner)).first()


def delete_webhook(session: Session, *, hook: Webhook) -> None:
    """The webhook and its deliveries (explicitly: SQLite may not enforce the cascade)."""
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.webhook_id == hook.id))
    session.delete(hook)
    session.flush()


def list_deliveries(session: Session, *, webhook_id: int, after: int = 0, limit: int = 100) -> list[WebhookDelivery]:
    q = (select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id, WebhookDelivery.id > after)
         .order_by(WebhookDelivery.id).limit(limit))
    return list(session.scalars(q))


def claim_due(session: Session, *, now: datetime, hold_s: float, busy_hooks: frozenset[int] = frozenset(),
              owner_room: Callable[[str], int] = lambda _owner: 1 << 30, per_hook: int = 16,
              max_hooks: int = 1 << 30, limit: int = 256) -> list[tuple[WebhookDelivery, Webhook]]:
    """Pending deliveries due by `now`, oldest first, each claimed by a conditional UPDATE (its next attempt
    moved past the sends before it and its own, `hold_s` each), so that of several deliverers one sends it;
    with their webhooks. None of `busy_hooks` (being sent to already), at most `per_hook` of one webhook, and
    of at most `owner_room(owner)` webhooks per owner: a deliverer sends one webhook's deliveries one after
    another, in order, and one owner's webhooks beside each other up to a bound (`max_hooks` in all)."""
    due = session.execute(select(WebhookDelivery.id, WebhookDelivery.webhook_id, Webhook.owner)
                          .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
                          .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now)
                          .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id).limit(limit)).all()
    taken: dict[int, int] = {}  # webhook -> deliveries claimed of it
    hooks_of: dict[str, set[int]] = {}
    claimed = []
    for row in due:
        mine = hooks_of.setdefault(row.owner, set())
        new_hook = row.webhook_id not in taken
        if row.webhook_id in busy_hooks or taken.get(row.webhook_id, 0) >= per_hook or (new_hook and (
                len(mine) >= owner_room(row.owner) or len(taken) >= max_hooks)):
            continue
        hold = now + timedelta(seconds=hold_s * (taken.get(row.webhook_id, 0) + 1))
        if session.execute(update(WebhookDelivery).where(
                WebhookDelivery.id == row.id, WebhookDelivery.status == "pending",
                WebhookDelivery.next_attempt_at <= now).values(next_attempt_at=hold)
                .execution_options(synchronize_session=False)).rowcount == 1:
            d = session.get(WebhookDelivery, row.id)
            if (hook := session.get(Webhook, d.webhook_id)) is not None:
                claimed.append((d, hook))
                mine.add(row.webhook_id)
                taken[row.webhook_id] = taken.get(row.webhook_id, 0) + 1
    return claimed


def record_attempt(session: Session, *, delivery_id: int, ok: bool, status: int | None, error: str | None) -> None:
    """One try's outcome: delivered, or retried after its backoff, or failed after the last."""
    d = session.get(WebhookDelivery, delivery_id)
    if d is None or d.status != "pending":
        return
    d.attempts += 1
    d.last_status, d.last_error = status, error
    now = datetime.now(UTC)
    if ok:
        d.status, d.delivered_at = "delivered", now
    elif (delay := hooks.retry_delay(d.attempts)) is None:
        d.status = "failed"
    else:
        d.next_attempt_at = now + timedelta(seconds=delay)
    session.flush()


def _payload(job: Job, ev: JobEvent, kind: str, delivery_created: datetime) -> dict:
    # an outcome is often set by an UPDATE this session has not loaded: the event says which it is
    status = ev.type if kind in hooks.TERMINAL_EVENTS.values() else job.status
    return {"type": kind, "created_at": delivery_created.isoformat(),
            "data": {"job": {"id": job.id, "uid": job.uid, "name": job.name, "kind": job.kind, "status": status,
                             "step": job.step, "total_steps": job.total_steps},
                     "event": {"type": ev.type, "level": ev.level, "message": ev.message, "data": ev.data}}}


@event.listens_for(Session, "before_flush")
def _enqueue_deliveries(session: Session, _context, _instances) -> None:
    raised = [(ev, kind) for ev in session.new if isinstance(ev, JobEvent)
              and (kind := hooks.event_type(ev.type, ev.level or "info")) is not None]
    if not raised:
        return
    with session.no_autoflush:
        for ev, kind in raised:
            job = session.get(Job, ev.job_id)
            if job is None:
                continue
            for hook in session.scalars(select(Webhook).where(Webhook.owner == job.owner)):
                if kind in hook.events:
                    now = utcnow()
                    session.add(WebhookDelivery(webhook_id=hook.id, job_id=job.id, event=kind,
                                                payload=_payload(job, ev, kind, now), status="pending", attempts=0,
                                                next_attempt_at=now, created_at=now))
