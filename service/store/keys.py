"""API keys: only a SHA-256 of each key is stored; the key itself is shown once."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.store.models import ApiKey

PREFIX = "gj_"


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, *, owner: str) -> str:
    key = PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(owner=owner, prefix=key[:10], key_hash=_hash(key)))
    session.flush()
    return key


def owner_for_key(session: Session, *, key: str) -> str | None:
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == _hash(key), ApiKey.revoked.is_(False)))
    return row.owner if row else None
