"""Webhooks: which events an owner's URLs are sent, how a delivery is signed, and when it is retried.

An owner registers URLs (checked against the admin's allow-list, `GRPO_WEBHOOK_URLS`, as grader URLs
are); each gets a secret, shown once. When a job of theirs ends (`job.succeeded`, `job.failed`,
`job.cancelled`) or one of its health guards turns red (`job.health`), a delivery is recorded in the
same transaction as the job's event, and the workers' deliverer POSTs it:

    POST <url>
    Content-Type: application/json
    Grpo-Webhook-Id: <delivery id>            (the same on every retry: deduplicate on it)
    Grpo-Webhook-Timestamp: <unix seconds>
    Grpo-Webhook-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>

    {"id": ..., "type": "job.succeeded", "created_at": "...", "data": {"job": {...}, "event": {...}}}

A receiver checks the signature over the timestamp and the raw body, and refuses an old timestamp
(a replay). A delivery answered with a 2xx is done; otherwise it is retried with exponential backoff
(`RETRY_DELAYS_S`) and marked failed after the last. Never imports torch or FastAPI.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Literal

EventType = Literal["job.succeeded", "job.failed", "job.cancelled", "job.health"]
EVENT_TYPES: tuple[str, ...] = ("job.succeeded", "job.failed", "job.cancelled", "job.health")
TERMINAL_EVENTS = {"succeeded": "job.succeeded", "failed": "job.failed", "cancelled": "job.cancelled"}
# seconds after the first try, the second, ...: about 2 hours in all, then the delivery has failed
RETRY_DELAYS_S: tuple[float, ...] = (5, 30, 120, 600, 1800, 3600)
MAX_PER_OWNER = 20
SIGNATURE = "Grpo-Webhook-Signature"
TIMESTAMP = "Grpo-Webhook-Timestamp"
DELIVERY_ID = "Grpo-Webhook-Id"


def new_secret() -> str:
    return "whsec_" + secrets.token_hex(24)


def event_type(job_event_type: str, level: str) -> str | None:
    """The webhook event a job event raises, if any: an outcome, or a red health flag."""
    if job_event_type in TERMINAL_EVENTS:
        return TERMINAL_EVENTS[job_event_type]
    if job_event_type == "health" and level == "error":
        return "job.health"
    return None


def signature(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"v1={mac}"


def verify(secret: str, timestamp: int, body: bytes, header: str) -> bool:
    """What a receiver does (in its own language): the signature of these bytes, compared in constant time."""
    return hmac.compare_digest(signature(secret, timestamp, body), header)


def retry_delay(attempts: int) -> float | None:
    """Seconds until the next try after `attempts` failed ones; None when it was the last."""
    return RETRY_DELAYS_S[attempts - 1] if attempts <= len(RETRY_DELAYS_S) else None
