"""The deliverer: a thread in every API process that POSTs due webhook deliveries.

It never holds up a job: a delivery is only a row, recorded with the job's event, until this thread
takes it; and it runs where nothing forks (a thread busy with the store in a worker's main process
could hold a lock when Celery forks the next job's process, and that process would hang on it). Each round claims the due deliveries (a conditional UPDATE moves each one's next attempt
past the send, so two workers never send it at once), sends each signed, and records the answer:
delivered on a 2xx, else retried after its backoff (service/core/webhooks.py). The URL is checked
against the allow-list again, resolved once, refused on a link-local or metadata address, called at
that very address, never redirected, and its answer's body is not read.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

import httpx

from service.core import webhooks as hooks
from service.core.grader_urls import UrlRefused, check_url, resolve_address
from service.core.settings import Settings
from service.store import webhooks as webhooks_q
from service.store.db import session_scope
from service.store.models import Webhook, WebhookDelivery
from service.store.periodic import Periodic

log = logging.getLogger(__name__)
POLL_S = 2.0


def send(delivery: WebhookDelivery, hook: Webhook, settings: Settings) -> tuple[bool, int | None, str | None]:
    """One signed POST of a delivery: (delivered, the answer's status, why not)."""
    body = json.dumps({"id": delivery.id, **delivery.payload}, separators=(",", ":")).encode()
    ts = int(time.time())
    headers = {"Content-Type": "application/json", hooks.DELIVERY_ID: str(delivery.id), hooks.TIMESTAMP: str(ts),
               hooks.SIGNATURE: hooks.signature(hook.secret, ts, body), "User-Agent": "grpo-jobs-webhooks"}
    try:
        url = check_url(hook.url, settings.webhook_urls, "GRPO_WEBHOOK_URLS", "webhooks")
        target = httpx.URL(str(url)).copy_with(host=resolve_address(url))
        extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
        with httpx.Client(timeout=settings.webhook_timeout_s, follow_redirects=False, trust_env=False,
                          headers={"Host": url.netloc}) as c:
            r = c.post(target, content=body, headers=headers, extensions=extensions)
    except UrlRefused as exc:
        return False, None, f"url {exc}"
    except (httpx.HTTPError, OSError) as exc:
        return False, None, f"{type(exc).__name__}: {exc}"[:500]
    if 200 <= r.status_code < 300:
        return True, r.status_code, None
    return False, r.status_code, f"answered HTTP {r.status_code}"


def deliver_once(settings: Settings) -> int:
    """Send every delivery due now; returns how many were tried."""
    now = datetime.now(UTC)
    with session_scope(settings.store_url) as s:  # claimed for longer than a send can take
        due = [(d.id, d, h) for d, h in webhooks_q.claim_due(s, now=now, hold_s=settings.webhook_timeout_s * 3 + 30)]
        s.expunge_all()
    for delivery_id, delivery, hook in due:
        ok, status, error = send(delivery, hook, settings)
        with session_scope(settings.store_url) as s:
            webhooks_q.record_attempt(s, delivery_id=delivery_id, ok=ok, status=status, error=error)
        if not ok:
            log.warning("webhook %s: delivery %s to %s failed (%s)", hook.id, delivery_id, hook.url, error)
    return len(due)


def deliverer(settings: Settings, *, ready: Callable[[], bool] = lambda: True) -> Periodic:
    """`deliver_once` every POLL_S in a thread, once `ready()` (the API's store is migrated)."""
    return Periodic("webhook-deliverer", lambda: ready() and deliver_once(settings), POLL_S, delay_first=True)
