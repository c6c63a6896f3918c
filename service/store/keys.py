"""API keys: only a SHA-256 of each key is stored; the key itself is shown once.

Keys may expire and can be revoked; each records when it was last used (at most once a minute,
so reads stay reads). A browser's EventSource cannot send headers, so the API hands out stream
tokens: short-lived, for one job's stream only, signed with the key's hash (revoking the key
revokes its tokens), and never the key itself in a URL.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.store.models import ApiKey, utcnow

PREFIX = "tml-"  # the tinker SDK takes only keys that start so; earlier keys (gj_...) still work
STREAM_TOKEN_PREFIX = "gjs_"
LAST_USED_EVERY = timedelta(minutes=1)


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, *, owner: str, expires_in: timedelta | None = None) -> str:
    key = PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(owner=owner, prefix=key[:10], key_hash=_hash(key),
                       expires_at=utcnow() + expires_in if expires_in else None))
    session.flush()
    return key


def _usable(row: ApiKey | None, now: datetime) -> bool:
    return row is not None and not row.revoked and (row.expires_at is None or row.expires_at > now)


def _touch(session: Session, row: ApiKey, now: datetime) -> None:
    """Stamp the key's last use in a short transaction of its own on the session's engine: the
    stamp is bookkeeping, so the request that presented the key never holds a write lock for it
    (on SQLite that lock would stall every other writer until the request ends)."""
    if row.last_used_at is None or row.last_used_at < now - LAST_USED_EVERY:
        with Session(session.get_bind()) as own, own.begin():
            own.execute(update(ApiKey).where(ApiKey.id == row.id).values(last_used_at=now)
                        .execution_options(synchronize_session=False))


def owner_for_key(session: Session, *, key: str) -> str | None:
    """The owner of a live (not revoked, not expired) key, or None."""
    now = utcnow()
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == _hash(key)))
    if not _usable(row, now):
        return None
    _touch(session, row, now)
    return row.owner


@dataclass(frozen=True)
class KeyInfo:
    id: int
    owner: str
    prefix: str
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked: bool


def list_keys(session: Session, *, owner: str | None = None) -> list[KeyInfo]:
    q = select(ApiKey).order_by(ApiKey.id)
    if owner is not None:
        q = q.where(ApiKey.owner == owner)
    return [KeyInfo(id=k.id, owner=k.owner, prefix=k.prefix, created_at=k.created_at, expires_at=k.expires_at,
                    last_used_at=k.last_used_at, revoked=k.revoked)
            for k in session.scalars(q)]


def revoke_key(session: Session, *, key_id: int) -> bool:
    result = session.execute(update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked.is_(False))
                             .values(revoked=True).execution_options(synchronize_session=False))
    return result.rowcount == 1


# -- stream tokens ---------------------------------------------------------------------------

def _sign(key_hash: str, payload: bytes) -> str:
    return base64.urlsafe_b64encode(hmac.new(key_hash.encode(), payload, hashlib.sha256).digest()[:24]).decode()


def stream_token(session: Session, *, key: str, job_id: int, ttl_s: int) -> tuple[str, datetime]:
    """A token that opens `job_id`'s stream for `ttl_s` seconds, for the holder of `key`."""
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == _hash(key)))
    expires = int(time.time()) + ttl_s
    payload = f"{row.id}.{job_id}.{expires}".encode()
    token = STREAM_TOKEN_PREFIX + base64.urlsafe_b64encode(payload).decode().rstrip("=") + "." + _sign(row.key_hash, payload)
    return token, datetime.fromtimestamp(expires, UTC)


def owner_for_stream_token(session: Session, *, token: str, job_id: int) -> str | None:
    """The owner a stream token was issued to, if it is for this job, unexpired, and its key is live."""
    try:
        body, signature = token.removeprefix(STREAM_TOKEN_PREFIX).split(".")
        payload = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        key_id, for_job, expires = (int(x) for x in payload.decode().split("."))
    except (ValueError, UnicodeDecodeError):
        return None
    if not token.startswith(STREAM_TOKEN_PREFIX) or for_job != job_id or expires < time.time():
        return None
    row = session.get(ApiKey, key_id)
    if not _usable(row, utcnow()) or not hmac.compare_digest(signature, _sign(row.key_hash, payload)):
        return None
    return row.owner
