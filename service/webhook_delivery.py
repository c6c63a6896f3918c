"""The deliverer: a thread in every API process that POSTs due webhook deliveries.

It never holds up a job: a delivery is only a row, recorded with the job's event, until a deliverer
takes it; and it runs where nothing forks (a thread busy with the store in a worker's main process
could hold a lock when Celery forks the next job's process, and that process would hang on it).

No receiver can hold it. Every POLL_S it claims what is due (a conditional UPDATE moves each one's
next attempt past its send, so two deliverers never send it at once) and starts sending it beside
what is already in flight, on one event loop: one webhook's deliveries one after another, in order;
up to OWNER_PARALLEL webhooks of one owner, and PARALLEL sends in all, at once. A send has one
deadline for the whole exchange (connect, request, the answer's status line and headers:
GRPO_WEBHOOK_TIMEOUT_S), reads at most the answer's head (h11 refuses one over 16 KiB) and never its
body. The URL is checked against the allow-list again, resolved once, refused on a link-local or
metadata address, called at that very address, and never redirected. The answer is recorded:
delivered on a 2xx, else retried after its backoff (service/core/webhooks.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

from service.core import webhooks as hooks
from service.core.grader_urls import UrlRefused, check_url, resolve_address
from service.core.settings import Settings
from service.store import webhooks as webhooks_q
from service.store.db import dispose_engines, session_scope
from service.store.models import Webhook, WebhookDelivery

log = logging.getLogger(__name__)
POLL_S = 1.0
OWNER_PARALLEL = 4  # webhooks of one owner sent to at once: a slow receiver costs its owner, nobody else
PARALLEL = 32  # sends in flight in one API process


@dataclass(frozen=True)
class Attempt:
    """One try's outcome: delivered or not, the answer's status if one came, and why not."""

    ok: bool
    status: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class Claimed:
    """A delivery taken for sending, with what sending it needs (read before its session closed)."""

    delivery_id: int
    webhook_id: int
    owner: str
    url: str
    secret: str
    body: bytes


def _claimed(delivery: WebhookDelivery, hook: Webhook) -> Claimed:
    body = json.dumps({"id": delivery.id, **delivery.payload}, separators=(",", ":")).encode()
    return Claimed(delivery_id=delivery.id, webhook_id=hook.id, owner=hook.owner, url=hook.url, secret=hook.secret,
                   body=body)


async def send(c: Claimed, settings: Settings) -> Attempt:
    """One signed POST of a delivery, all of it within GRPO_WEBHOOK_TIMEOUT_S; the answer's body is not read."""
    ts = int(time.time())
    headers = {"Content-Type": "application/json", hooks.DELIVERY_ID: str(c.delivery_id), hooks.TIMESTAMP: str(ts),
               hooks.SIGNATURE: hooks.signature(c.secret, ts, c.body), "User-Agent": "grpo-jobs-webhooks"}
    deadline = settings.webhook_timeout_s
    try:
        async with asyncio.timeout(deadline):
            url = check_url(c.url, settings.webhook_urls, "GRPO_WEBHOOK_URLS", "webhooks")
            target = httpx.URL(str(url)).copy_with(host=await asyncio.to_thread(resolve_address, url))
            extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
            async with httpx.AsyncClient(timeout=deadline, follow_redirects=False, trust_env=False,
                                         headers={"Host": url.netloc}) as client:
                async with client.stream("POST", target, content=c.body, headers=headers,
                                         extensions=extensions) as answer:
                    status = answer.status_code  # closed unread: a large or dripping body costs nothing
    except UrlRefused as exc:
        return Attempt(False, error=f"url {exc}")
    except TimeoutError:
        return Attempt(False, error=f"no whole answer within {deadline:g} s (GRPO_WEBHOOK_TIMEOUT_S)")
    except (httpx.HTTPError, OSError) as exc:
        return Attempt(False, error=f"{type(exc).__name__}: {exc}"[:500])
    if 200 <= status < 300:
        return Attempt(True, status)
    return Attempt(False, status, f"answered HTTP {status}")


def _record(settings: Settings, c: Claimed, attempt: Attempt) -> None:
    with session_scope(settings.store_url) as s:
        webhooks_q.record_attempt(s, delivery_id=c.delivery_id, ok=attempt.ok, status=attempt.status,
                                  error=attempt.error)
    if not attempt.ok:
        log.warning("webhook %s: delivery %s to %s failed (%s)", c.webhook_id, c.delivery_id, c.url, attempt.error)


class Sender:
    """What one deliverer has in flight: the webhooks being sent to and how many of each owner's."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.busy_hooks: set[int] = set()
        self.per_owner: Counter[str] = Counter()
        self.tasks: set[asyncio.Task] = set()

    def _claim(self, busy: frozenset[int], per_owner: dict[str, int]) -> dict[int, list[Claimed]]:
        """Due deliveries there is room for beside `busy` (webhooks in flight) and `per_owner` (how many of
        each owner's), by webhook, in order. Runs in a thread: it reads only these copies."""
        room = PARALLEL - len(busy)
        if room <= 0:
            return {}
        with session_scope(self.settings.store_url) as s:
            chains: dict[int, list[Claimed]] = {}
            for delivery, hook in webhooks_q.claim_due(
                    s, now=datetime.now(UTC), hold_s=self.settings.webhook_timeout_s + 30,
                    busy_hooks=busy, max_hooks=room,
                    owner_room=lambda owner: OWNER_PARALLEL - per_owner.get(owner, 0)):
                chains.setdefault(hook.id, []).append(_claimed(delivery, hook))
            return chains

    async def _chain(self, webhook_id: int, chain: list[Claimed]) -> None:
        try:
            for c in chain:
                await asyncio.to_thread(_record, self.settings, c, await send(c, self.settings))
        finally:
            self.busy_hooks.discard(webhook_id)
            self.per_owner[chain[0].owner] -= 1

    async def start_due(self) -> int:
        """Start sending what is due (beside what is in flight); returns how many deliveries were taken."""
        chains = await asyncio.to_thread(self._claim, frozenset(self.busy_hooks), dict(self.per_owner))
        for webhook_id, chain in chains.items():
            self.busy_hooks.add(webhook_id)
            self.per_owner[chain[0].owner] += 1
            task = asyncio.create_task(self._chain(webhook_id, chain))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return sum(map(len, chains.values()))


def deliver_once(settings: Settings) -> int:
    """Send every delivery due now and wait for the answers; returns how many were tried."""

    async def once() -> int:
        sender = Sender(settings)
        taken = await sender.start_due()
        await asyncio.gather(*sender.tasks)
        return taken

    return asyncio.run(once())


class Deliverer:
    """The API process's deliverer thread: every POLL_S, once `ready()` (the API's store is migrated), it
    starts what is due beside what is in flight."""

    def __init__(self, settings: Settings, ready: Callable[[], bool]) -> None:
        self.settings, self.ready = settings, ready
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._loop()), name="webhook-deliverer",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.settings.webhook_timeout_s + 5)

    async def _loop(self) -> None:
        sender = Sender(self.settings)
        while not self._stop.is_set():
            await asyncio.sleep(POLL_S)
            try:
                if self.ready():
                    await sender.start_due()
            except Exception as exc:  # the store away: the next round tries again
                log.warning("webhook deliverer: %s: %s", type(exc).__name__, exc)
                await asyncio.to_thread(dispose_engines, close=True)
        for task in list(sender.tasks):  # the process is stopping: what was claimed is sent again after its hold
            task.cancel()


def deliverer(settings: Settings, *, ready: Callable[[], bool] = lambda: True) -> Deliverer:
    return Deliverer(settings, ready)
